"""Lowering for an NVIDIA GPU on a machine that has none.

Pallas' Triton lowering asks the device it lowers for which GPU it is (its
compute capability picks the Triton target). From jax 0.11 on, a process
without a GPU has to name one: an ``AbstractDevice`` set through
``jax.sharding.use_abstract_mesh`` (the error JAX raises otherwise says so).
``abstract_gpu()`` is that context; inside it,
``jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))`` and
``jax.export.export(f, platforms=("cuda",))`` lower the kernels for that GPU.
On a machine with a GPU of the same kind the context changes nothing.

The Triton kernel is an XLA custom call named ``TRITON_CUSTOM_CALL``; the
name is JAX's (``jax/_src/pallas/triton/pallas_call_registration.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

# The custom call target of a Pallas Triton kernel in lowered StableHLO.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
# The H100 SXM: 132 streaming multiprocessors (NVIDIA H100 datasheet).
H100 = AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")


@contextlib.contextmanager
def abstract_gpu(device: AbstractDevice = H100) -> Iterator[None]:
    """Lowers for ``device`` (default: an H100) within the ``with`` block.

    Raises:
      ValueError: ``device.platform`` is not ``"gpu"``.
    """
    if device.platform != "gpu":
        raise ValueError(f"abstract_gpu needs a GPU device, got platform {device.platform!r}")
    mesh = AbstractMesh((1,), ("gpu",), (AxisType.Explicit,), abstract_device=device)
    with use_abstract_mesh(mesh):
        yield
