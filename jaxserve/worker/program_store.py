"""Traced step programs on disk, so that a restart neither traces nor lowers.

JAX's persistent compilation cache saves the XLA compile, but a restart
must still trace and lower every executable to compute its cache key; for
the step executables that was most of a warm start (the sampler alone lowers
in ~0.3 s, a 30-layer body in ~1 s on this CPU), which kept a warm start at
~4x a cold one. This store keeps each executable's *traced program*
(``jax.export``: serialized StableHLO plus its argument and result trees).
On a restart the program is deserialized and compiled — a JAX persistent
cache hit, since the same program was compiled on the first start — without
running any of the model's Python.

Executables themselves are deliberately not stored: XLA:CPU executables
serialized by hand (``jax.experimental.serialize_executable``) failed to run
in another process ("Function wrapped_iota not found") when the compiling
process had loaded kernels of the same name before; JAX's own cache is the
one tested path for executables.

Entries are keyed by everything that determines the program:

- the executable's name and shape material (``StepExecutable.key``: T or R,
  rows, vocabulary, cache and parameter shapes and dtypes, the model graph,
  the attention backend);
- jax and jaxlib versions and the platform;
- a fingerprint of the source of every module that is traced into a step
  (``jaxserve/model``, ``jaxserve/worker``, ``pallas_kernels``, ``cpu_kernels``
  with its C++, ``jaxserve/config.py``): edit the model and the old entries no
  longer match.

A missing or unreadable entry is traced again and rewritten. Files:
``<directory>/<sha256>.program`` (pickle of the serialized ``Exported`` and
the result tree), written to a temporary file and renamed.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import pickle
import tempfile
from typing import Any

import jax
import jaxlib
from jax import export

import cpu_kernels

logger = logging.getLogger(__name__)

_TRACED_SOURCES = ("jaxserve/model", "jaxserve/worker", "pallas_kernels", "cpu_kernels",
                   "jaxserve/config.py")
# Pallas' Triton kernels and the C++ CPU kernels are custom calls that jax.export
# does not vouch for across versions; the key pins the versions and the sources,
# so they are safe to store here.
_DISABLED_CHECKS = (export.DisabledSafetyCheck.custom_call("triton_kernel_call"),
                    export.DisabledSafetyCheck.custom_call(cpu_kernels.TARGET),
                    export.DisabledSafetyCheck.custom_call(cpu_kernels.MATMUL_TARGET))


@functools.cache
def code_fingerprint() -> str:
    """sha256 of the source files traced into step executables (computed once per process)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for entry in _TRACED_SOURCES:
        path = root / entry
        files = (sorted([*path.rglob("*.py"), *path.rglob("*.cc"), *path.rglob("*.h")])
                 if path.is_dir() else [path])
        for file in files:
            digest.update(str(file.relative_to(root)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def export_program(jitted, flat_specs: list[jax.ShapeDtypeStruct]) -> export.Exported:
    """Traces and lowers ``jitted`` (a ``jax.jit`` over flat arguments) into a portable program."""
    return export.export(jitted, disabled_checks=_DISABLED_CHECKS)(*flat_specs)


class ProgramStore:
    """A directory of traced step programs.

    Args:
      directory: where entries live (created on first save).
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)
        self._environment = "|".join([jax.__version__, jaxlib.__version__,
                                      jax.devices()[0].platform, code_fingerprint()])

    def key(self, name: str, material: str) -> str:
        """The entry key of executable ``name`` whose shapes are described by ``material``."""
        return hashlib.sha256(f"{name}|{material}|{self._environment}".encode()).hexdigest()

    def load(self, key: str) -> tuple[export.Exported, Any] | None:
        """(program, result tree) stored under ``key``, or None when absent or unreadable."""
        path = self.directory / f"{key}.program"
        try:
            with open(path, "rb") as f:
                payload, out_tree = pickle.load(f)
            return export.deserialize(payload), out_tree
        except FileNotFoundError:
            return None
        except Exception as err:  # noqa: BLE001 - a bad entry is traced again, not fatal
            logger.warning("program store entry %s is unusable (%s); tracing again", path.name, err)
            return None

    def save(self, key: str, program: export.Exported, out_tree: Any) -> None:
        """Writes ``program`` under ``key`` atomically (failures are logged, not raised)."""
        try:
            payload = pickle.dumps((program.serialize(), out_tree))
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False,
                                             suffix=".tmp") as f:
                f.write(payload)
            os.replace(f.name, self.directory / f"{key}.program")
        except Exception as err:  # noqa: BLE001 - the store is an optimisation
            logger.warning("could not store program %s: %s", key[:12], err)
