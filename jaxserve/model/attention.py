"""The model's attention interface: ``paged_attention(q, k_cache, v_cache, metadata)``.

Backends (``ATTENTION_BACKENDS``):
  ``cpu`` — the C++ CPU kernel (``cpu_kernels``, an XLA FFI custom call), the CPU
  default where it builds;
  ``reference`` — pure jnp (pallas_kernels.ragged_paged_attention), the CPU
  default where the C++ kernel cannot be built, and every kernel's oracle;
  ``pallas`` — the Pallas GPU kernel (``rpa.ragged_paged_attention``, Triton
  lowering), the GPU default;
  ``pallas_interpret`` — the same kernel in Pallas interpret mode (CPU tests).
All implement one contract (see ``pallas_kernels.ragged_paged_attention``).
"""

from __future__ import annotations

import dataclasses

import jax

import cpu_kernels
from pallas_kernels import ragged_paged_attention as rpa

ATTENTION_BACKENDS = ("cpu", "reference", "pallas", "pallas_interpret")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs shared by every layer.

    R is the padded row count the step was compiled for; rows with
    ``seq_lens == 0`` and no query tokens are padding.
    """

    slot_mapping: jax.Array  # i32[T] cache slot of each token (padding → null block)
    block_table: jax.Array  # i32[R, MB] physical block ids (padding → null block)
    seq_lens: jax.Array  # i32[R] tokens per row including this step's
    query_start_loc: jax.Array  # i32[R + 1] first query token of each row
    # i32[NT, 5] the Pallas kernel's tile schedule, computed once per step by
    # ``with_schedule`` for every layer; None: each call computes its own.
    tiles: jax.Array | None = None


def default_backend(head_dim: int | None = None) -> str:
    """``pallas`` on a GPU; elsewhere ``cpu`` when its kernel builds and supports
    ``head_dim`` (``cpu_kernels.HEAD_DIMS``; None: any), else ``reference``."""
    if jax.default_backend() == "gpu":
        return "pallas"
    if head_dim is not None and head_dim not in cpu_kernels.HEAD_DIMS:
        return "reference"
    return "cpu" if cpu_kernels.available() else "reference"


def check_backend(backend: str) -> None:
    """Raises ValueError unless ``backend`` can run here (for ``cpu``: on the CPU platform,
    its kernel built)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
    if backend == "cpu" and jax.default_backend() != "cpu":
        raise ValueError(f"attention backend 'cpu' runs on the CPU only; this platform is "
                         f"{jax.default_backend()!r}")
    if backend == "cpu" and not cpu_kernels.available():
        raise ValueError(f"attention backend 'cpu': {cpu_kernels.unavailable_reason()}; "
                         "use 'reference'")


def with_schedule(metadata: AttentionMetadata, *, num_tokens: int, num_heads: int,
                  k_cache: jax.Array, backend: str, num_shards: int = 1,
                  dtype=None) -> AttentionMetadata:
    """The metadata with the kernel's tile schedule, computed once for all layers.

    For the Pallas backends, ``rpa.attention_schedule`` (which query tokens
    each program serves) depends only on the step's metadata and the model's
    shapes, so the model computes it once per step and every layer's call
    reuses it instead of deriving it again. The reference backend needs none.

    Args:
      metadata: the step's metadata (``tiles`` None).
      num_tokens: T. num_heads: N.
      k_cache: one layer's cache ``[B, K, S, H]`` or the stacked ``[L, B, K, S, H]``
        (only its shape and dtype are read).
      dtype: q's dtype, which picks the kernel's tuning; None: the cache's (an
        fp8 cache needs q's).
      backend: one of ATTENTION_BACKENDS.
      num_shards: TP; the kernel runs per device over N / TP heads and K / TP
        KV heads (``jaxserve.model.sharding``).
    """
    if backend not in ("pallas", "pallas_interpret"):
        return metadata
    num_kv_heads, block_size, head_dim = k_cache.shape[-3:]
    tiles = rpa.attention_schedule(
        metadata.query_start_loc, metadata.seq_lens, num_tokens=num_tokens,
        num_heads=num_heads // num_shards, num_kv_heads=num_kv_heads // num_shards,
        head_dim=head_dim, block_size=block_size, dtype=dtype or k_cache.dtype)
    return dataclasses.replace(metadata, tiles=tiles)


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    metadata: AttentionMetadata, *, sm_scale: float, backend: str,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    k_scale: jax.Array | None = None,
                    v_scale: jax.Array | None = None) -> jax.Array:
    """Ragged causal attention for all rows of a step; see ``ragged_paged_attention_reference``.

    Args:
      q: [T, N, H]; k_cache, v_cache: [B, K, S, H] with the step's K/V written,
        in q's dtype or fp8 (``kv_cache.FP8_DTYPE``; every backend widens the
        stored values as it reads them).
      backend: one of ATTENTION_BACKENDS.
      k_scale, v_scale: an fp8 cache's f32 scalars for this layer (a stored key
        is key / k_scale). The kernels read unscaled values; since
        ``q·(k·ks) = (q·ks)·k`` and ``Σ p·(v·vs) = (Σ p·v)·vs``, q is multiplied
        by k_scale before the kernel and the output by v_scale after it.

    Returns:
      [T, N, H] in q's dtype.

    Raises:
      ValueError: unknown backend.
    """
    if k_scale is not None:
        q = (q * k_scale).astype(q.dtype)
    out = _attend(q, k_cache, v_cache, metadata, sm_scale=sm_scale, backend=backend,
                  sliding_window=sliding_window, soft_cap=soft_cap)
    return out if v_scale is None else (out * v_scale).astype(out.dtype)


def _attend(q, k_cache, v_cache, metadata, *, sm_scale, backend, sliding_window, soft_cap):
    if backend == "cpu":
        return cpu_kernels.ragged_paged_attention(
            q, k_cache, v_cache, metadata.block_table, metadata.seq_lens,
            metadata.query_start_loc, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap)
    if backend == "reference":
        return rpa.ragged_paged_attention_reference(
            q, k_cache, v_cache, metadata.block_table, metadata.seq_lens,
            metadata.query_start_loc, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap)
    if backend in ("pallas", "pallas_interpret"):
        return rpa.ragged_paged_attention(
            q, k_cache, v_cache, metadata.block_table, metadata.seq_lens,
            metadata.query_start_loc, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, interpret=backend == "pallas_interpret", tiles=metadata.tiles)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
