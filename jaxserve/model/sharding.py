"""Tensor parallelism: the device mesh, and how every parameter and the KV cache are split.

One worker drives ``tensor_parallel_size`` (TP) devices through a 1-D
``jax.sharding.Mesh`` whose one axis is ``TP_AXIS``. The split is Megatron-LM's
(Shoeybi et al., 2019, section 3), as vLLM does it:

Kernels are stored ``[out, in]`` (``jaxserve.model.llama.linear``).

- column-parallel ``qkv_proj`` ``[(N + 2K)·H, D]`` and ``gate_up_proj``
  ``[2F, D]``: device i holds whole query heads ``i·N/TP ..``, their KV heads
  and the i-th slice of the MLP's F outputs. The loader stores the fused
  output rows **grouped by device** (``fused_output_order``): group i is
  ``[q heads of i | k heads of i | v heads of i]``, or ``[gate_i | up_i]``, so a
  plain split of the output axis into TP equal parts gives every device whole
  heads. With TP = 1 the layout is the usual ``[q | k | v]`` and ``[gate | up]``.
- row-parallel ``o_proj`` ``[D, N·H]`` and ``down_proj`` ``[D, F]``: split on
  their input axis; XLA inserts one all-reduce after each (two per layer).
- the embedding and the LM head, both ``[V, D]``, are split over the
  vocabulary when TP divides V (else replicated); the logits are gathered to
  full rows before the sampler, so sampling is exactly TP = 1's.
- weight-only int8 (``jaxserve.model.quantization``): a kernel's scale
  ``<name>_scale`` f32[out] splits with its kernel's output axis — with
  ``qkv_proj`` / ``gate_up_proj`` and, over the vocabulary, the embedding's
  and LM head's — and is replicated for the row-parallel ``o_proj`` /
  ``down_proj``, whose outputs are not split; int4's group scales are not split
  (int4 with TP > 1 is refused at start-up, ``jaxserve.config.check_quantization``);
- norms are replicated; the KV cache ``[B, K, S, H]`` is split over its KV
  heads, and attention runs per device under ``jax.shard_map``.

KV heads: with K ≥ TP each device holds K / TP of them (TP must divide K).
With TP > K (TP a multiple of K) each KV head is **replicated** on TP / K
devices: the model is built with ``num_kv_heads = TP``
(``ModelConfig.for_tensor_parallel``)
and KV head j of that model is the checkpoint's head ``j·K // TP`` — the same
grouped-query attention, each device holding the one KV head its query heads
read. Shapes that fit neither way are refused at start-up (``ValueError``).

Everything else the worker keeps (rows, last tokens, the packed step buffer)
is replicated on every device of the mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.model.quantization import SCALE_SUFFIX

TP_AXIS = "tp"

# Parameter name → the axis (counted from the end) split over the mesh.
_COLUMN = ("qkv_proj", "gate_up_proj")  # output features: the second-to-last axis of [out, in]
_ROW = ("o_proj", "down_proj")  # input features: the last axis
_BIAS = ("qkv_bias",)  # a bias [out] splits like its outputs: its only (last) axis


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh | None:
    """The 1-D tensor-parallel mesh over the first TP devices; None for TP = 1.

    Args:
      tensor_parallel_size: TP >= 1.
      devices: the devices to choose from (default ``jax.devices()``, every
        process's devices in a multi-process job).

    Raises:
      ValueError: TP < 1, or fewer than TP devices.
    """
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size == 1:
        return None
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} devices, "
            f"but only {len(devices)} {'is' if len(devices) == 1 else 'are'} visible "
            f"({devices[0].platform}); on a CPU, "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N devices")
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP_AXIS,))


def mesh_size(mesh: Mesh | None) -> int:
    """TP: the number of devices of the mesh (1 for None)."""
    return 1 if mesh is None else mesh.shape[TP_AXIS]


def kv_head_sources(config: ModelConfig, num_kv_heads: int) -> list[int]:
    """For each of the built model's ``num_kv_heads`` KV heads, the checkpoint's KV head."""
    return [j * config.num_kv_heads // num_kv_heads for j in range(num_kv_heads)]


def fused_output_order(sizes: tuple[int, ...], num_shards: int) -> np.ndarray:
    """Permutation of a fused projection's output features that groups its parts by device.

    Args:
      sizes: the output widths of the concatenated parts, e.g. ``(N·H, K·H, K·H)``
        for q, k, v or ``(F, F)`` for gate, up; each divisible by ``num_shards``.
      num_shards: TP.

    Returns:
      i64[sum(sizes)]: ``fused[order]`` (rows of an ``[out, in]`` kernel, or a
      bias) is ``[part 0 of device 0 | part 1 of device 0 | ... | part 0 of
      device 1 | ...]``; the identity for TP = 1.
    """
    starts = np.cumsum((0,) + sizes[:-1])
    return np.concatenate([
        np.arange(start + i * (size // num_shards), start + (i + 1) * (size // num_shards))
        for i in range(num_shards) for start, size in zip(starts, sizes)])


def param_partition_spec(path: tuple, ndim: int, vocab_size: int, num_shards: int) -> P:
    """How one parameter is split (``path``: its key path in the pure-dict params).

    Scanned models' layer parameters have a leading ``[L]`` axis, which is never
    split: the split axis is counted from the end.
    """
    name = str(path[-1]) if path[-1] != "weight" else str(path[-2])
    axis = None
    if name.endswith(SCALE_SUFFIX):  # f32[out] (or [L, out]): split as its kernel's outputs
        kernel = name[:-len(SCALE_SUFFIX)]
        if kernel in _COLUMN or (kernel in ("embed", "lm_head") and vocab_size % num_shards == 0):
            axis = ndim - 1
    elif name in _COLUMN:
        axis = ndim - 2
    elif name in _ROW or name in _BIAS:
        axis = ndim - 1
    elif name in ("embed", "lm_head") and vocab_size % num_shards == 0:
        axis = ndim - 2  # [V, D]
    if axis is None:
        return P()
    return P(*[TP_AXIS if a == axis else None for a in range(ndim)])


def param_shardings(params, mesh: Mesh, vocab_size: int):
    """A ``NamedSharding`` for every leaf of the pure-dict ``params`` (arrays or specs)."""
    tp = mesh_size(mesh)

    def one(path, leaf):
        keys = tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path)
        return NamedSharding(mesh, param_partition_spec(keys, len(leaf.shape), vocab_size, tp))

    return jax.tree_util.tree_map_with_path(one, params)


def kv_cache_partition_spec(ndim: int) -> P:
    """A KV cache array ``[B, K, S, H]`` (or stacked ``[L, B, K, S, H]``) split on K."""
    return P(*([None] * (ndim - 3)), TP_AXIS, None, None)


def on_every_device(fn, mesh: Mesh | None):
    """``fn`` run whole on every device of the mesh, on replicated inputs and outputs.

    For computations every device repeats identically (the sampler on full
    logits rows): ``jax.shard_map`` with replicated specs keeps XLA's SPMD
    partitioner out of them. ``fn`` itself without a mesh.
    """
    if mesh is None:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)


def replicated(mesh: Mesh | None) -> NamedSharding | None:
    """Every device of the mesh holds the whole array; None (the default device) without one."""
    return None if mesh is None else NamedSharding(mesh, P())


def place(tree, target: NamedSharding | None):
    """Host arrays (the same on every process) onto ``target``: ``jax.device_put``, except that
    in a multi-process job (``target`` not fully addressable) each process places only its own
    devices' shards (``jax.make_array_from_callback``), with no cross-process check or copy.
    """
    if target is None or target.is_fully_addressable:
        return jax.device_put(tree, target)
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, target, lambda index: x[index]), tree)
