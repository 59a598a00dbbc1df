"""How many KV blocks the worker allocates.

In order of precedence (``WorkerInit``):

1. ``num_kv_blocks`` — as given;
2. ``kv_cache_bytes`` — that many bytes of blocks;
3. automatic — on a device that reports its memory (GPU, TPU:
   ``Device.memory_stats()``), what is left of ``total × memory_utilization``
   (capped by JAX's pool, ``bytes_limit``) after what is in use (the
   weights, loaded before sizing) and the peak activations of the largest
   buckets, read from ``compiled.memory_analysis()`` of the largest-T body
   and the largest-R sampler; on CPU, which reports no memory,
   ``DEFAULT_CPU_KV_CACHE_BYTES`` (the configured budget is
   ``kv_cache_bytes``). A GPU or TPU that reports no memory is an error
   (give ``kv_cache_bytes`` or ``num_kv_blocks``), never the CPU's 1 GiB.

``memory_utilization`` is a fraction of the device's total memory, as vLLM's
``--gpu-memory-utilization``. On a GPU, JAX's pool (``bytes_limit``) is
``XLA_PYTHON_CLIENT_MEM_FRACTION`` (default 0.75) of the total, so the total
is ``bytes_limit`` / that fraction; the launcher sets the fraction of a worker
process to ``memory_utilization`` so the pool holds all of it.

vLLM sizes its cache the same way from a profiling run; here the compiler's
own accounting of temporaries replaces the run. Two allowances on top of it:

- the body's and the sampler's temporaries are *added*, not maxed: with
  async scheduling step N+1's body is enqueued while step N's sampler
  buffers are still held;
- ``HEADROOM_FRACTION`` of the budget stays free for what is allocated after
  sizing (the persistent rows, per-step uploads and outputs) and for the
  allocator's fragmentation. Without it an 8B model on an H200 sized its
  cache to leave exactly the estimated 805 MiB, and the first 64-row
  sampler step failed to allocate 803 MiB (2026-12-04).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # CPU memory is not reported by JAX; a fixed budget
# JAX's GPU pool as a fraction of the total memory when XLA_PYTHON_CLIENT_MEM_FRACTION is
# unset (https://docs.jax.dev/en/latest/gpu_memory_allocation.html).
DEFAULT_GPU_POOL_FRACTION = 0.75
# Of the automatic budget, the share left free beside the measured activations (see above).
HEADROOM_FRACTION = 0.02


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceMemory:
    """A device's memory, bytes: JAX's limit, what is in use now, and the device's total.

    ``total_bytes`` defaults to ``bytes_limit`` (a TPU's limit is its HBM).
    """

    bytes_limit: int
    bytes_in_use: int
    total_bytes: int | None = None

    @property
    def total(self) -> int:
        return self.bytes_limit if self.total_bytes is None else self.total_bytes


def gpu_pool_fraction(env=os.environ) -> float:
    """JAX's GPU pool as a fraction of total memory (``XLA_PYTHON_CLIENT_MEM_FRACTION``)."""
    return float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_GPU_POOL_FRACTION))


def device_memory(devices) -> DeviceMemory | None:
    """The tightest of ``devices``' ``memory_stats()``; None where not reported (CPU).

    Every device of a tensor-parallel mesh holds the same share of the KV
    cache, so the device with the least free memory sizes it.
    """
    found = []
    for device in devices:
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        limit = int(stats["bytes_limit"])
        total = int(limit / gpu_pool_fraction()) if device.platform == "gpu" else None
        found.append(DeviceMemory(limit, int(stats.get("bytes_in_use", 0)), total))
    return min(found, key=lambda m: m.bytes_limit - m.bytes_in_use)


def peak_activation_bytes(compiled: Sequence) -> int:
    """Temporary + non-aliased output bytes, summed over compiled executables.

    Args:
      compiled: ``jax.stages.Compiled`` objects (their ``memory_analysis()``),
        executables whose buffers can be held at once (a step's body and the
        previous step's sampler, under async scheduling), so their bytes add.
        Donated (aliased) outputs such as the KV cache reuse their inputs'
        memory and are not counted.
    """
    peak = 0
    for c in compiled:
        m = c.memory_analysis()
        if m is None:
            continue
        peak += m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return peak


def blocks_from_free_memory(memory: DeviceMemory, activation_bytes: int, utilization: float,
                            bytes_per_block: int) -> int:
    """KV blocks that fit in ``budget − in use − activations − HEADROOM_FRACTION × budget``.

    ``budget`` is ``min(total × utilization, limit)``.

    Raises:
      ValueError: utilization outside (0, 1], or fewer than 2 blocks fit
        (the message gives the numbers).
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"memory_utilization must be in (0, 1], got {utilization}")
    budget = min(int(memory.total * utilization), memory.bytes_limit)
    free = budget - memory.bytes_in_use - activation_bytes - int(budget * HEADROOM_FRACTION)
    blocks = max(free, 0) // bytes_per_block
    if blocks < 2:
        raise ValueError(
            f"no room for a KV cache: min({memory.total} B x {utilization}, pool "
            f"{memory.bytes_limit} B) - "
            f"{memory.bytes_in_use} B in use - {activation_bytes} B of activations leaves "
            f"{free} B, fewer than 2 blocks of {bytes_per_block} B")
    return blocks


def num_kv_blocks(*, num_blocks: int | None, kv_cache_bytes: int | None, bytes_per_block: int,
                  memory: DeviceMemory | None, utilization: float,
                  activation_bytes=lambda: 0, platform: str = "cpu") -> int:
    """The number of blocks B (null block included), by the rules in the module docstring.

    Args:
      num_blocks, kv_cache_bytes: ``WorkerInit``'s explicit settings.
      bytes_per_block: one block over all layers, K and V.
      memory: the device's memory (None where not reported).
      utilization: ``WorkerInit.memory_utilization``.
      activation_bytes: a callable returning the peak activation bytes; only
        called for automatic sizing on a device that reports memory (it
        compiles the largest buckets).
      platform: the device's ``Device.platform``: "cpu" takes the fixed CPU budget
        when no memory is reported; any other raises.

    Raises:
      ValueError: automatic sizing on a non-CPU device that reports no memory,
        ``kv_cache_bytes`` below 2 blocks, or no room for 2 blocks
        (``blocks_from_free_memory``).
    """
    if num_blocks is not None:
        return num_blocks
    if kv_cache_bytes is not None:
        blocks = kv_cache_bytes // bytes_per_block
        if blocks < 2:
            raise ValueError(
                f"a KV cache of {kv_cache_bytes} bytes (--kv-cache-bytes; LLM(kv_cache_bytes=...)) "
                f"holds {blocks} of the 2 blocks it needs at least: a block takes "
                f"{bytes_per_block} bytes, so give at least {2 * bytes_per_block}")
        return blocks
    if memory is None:
        if platform != "cpu":
            raise ValueError(
                f"the {platform} device reports no memory statistics, so the KV cache cannot be "
                "sized from free memory: give its size (--kv-cache-bytes or --num-kv-blocks; "
                "LLM(kv_cache_bytes=...) or num_kv_blocks=...)")
        return DEFAULT_CPU_KV_CACHE_BYTES // bytes_per_block
    activations = activation_bytes()
    blocks = blocks_from_free_memory(memory, activations, utilization, bytes_per_block)
    logger.info("KV cache from device memory: total %.2f GiB x %.2f (pool %.2f GiB), in use "
                "%.2f GiB, activations %.1f MiB -> %d blocks of %.2f MiB", memory.total / 2**30,
                utilization, memory.bytes_limit / 2**30, memory.bytes_in_use / 2**30,
                activations / 2**20, blocks,
                bytes_per_block / 2**20)
    return blocks
