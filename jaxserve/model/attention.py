"""The model's attention interface: ``paged_attention(q, k_cache, v_cache, metadata)``.

Backends (``ATTENTION_BACKENDS``):
  ``reference`` — pure jnp (pallas_kernels.ragged_paged_attention), the CPU default;
  ``pallas`` — the Pallas GPU kernel (``rpa.ragged_paged_attention``, Triton
  lowering), the GPU default;
  ``pallas_interpret`` — the same kernel in Pallas interpret mode (CPU tests).
Both implement one contract (see ``pallas_kernels.ragged_paged_attention``).
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels import ragged_paged_attention as rpa

ATTENTION_BACKENDS = ("reference", "pallas", "pallas_interpret")


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


def default_backend() -> str:
    """``pallas`` on a GPU, ``reference`` elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    metadata: AttentionMetadata, *, sm_scale: float, backend: str,
                    sliding_window: int | None = None,
                    soft_cap: float | None = None) -> jax.Array:
    """Ragged causal attention for all rows of a step; see ``ragged_paged_attention_reference``.

    Args:
      q: [T, N, H]; k_cache, v_cache: [B, K, S, H] with the step's K/V written.
      backend: one of ATTENTION_BACKENDS.

    Returns:
      [T, N, H] in q's dtype.

    Raises:
      ValueError: unknown backend.
    """
    if backend == "reference":
        return rpa.ragged_paged_attention_reference(
            q, k_cache, v_cache, metadata.block_table, metadata.seq_lens,
            metadata.query_start_loc, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap)
    if backend in ("pallas", "pallas_interpret"):
        return rpa.ragged_paged_attention(
            q, k_cache, v_cache, metadata.block_table, metadata.seq_lens,
            metadata.query_start_loc, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, interpret=backend == "pallas_interpret")
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
