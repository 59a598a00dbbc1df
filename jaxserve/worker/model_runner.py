"""The worker's jitted executables: the body keyed on T, logits + sampler keyed on R.

- ``run_body``: every layer over the step's T tokens (attention metadata with
  a fixed RA = ``max_num_seqs`` rows), then the final hidden state of each
  sampling row's last token, gathered into a fixed ``[RA, D]``: so its
  output shape does not depend on T and the next executable is keyed on R
  alone. The KV cache is donated (updated in place).
- ``run_sampler``: the LM head over the first R gathered rows and the
  sampler (``jaxserve.worker.sampler.sample``).
- ``gather_penalty_rows`` / ``add_output_counts``: the penalty statistics
  (``prompt_mask``, ``output_counts``) live on the device, ``[M, V]``, one
  row per worker row; they are touched only in steps where a sampling row
  has a penalty.

So the step executables number |T ladder| + |R ladder|, not the product;
the penalty helpers add 3 per R (``gather_penalty_rows``,
``add_output_counts``, ``penalty_zeros``) plus ``set_penalty_row`` and the
``[M, V]`` ``penalty_zeros``, all compiled at start-up
(``jaxserve.worker.executables``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.graph import StaticGraph
from jaxserve.model.kv_cache import KVCache
from jaxserve.worker.sampler import SamplerOutput, SamplingMetadata, sample


@functools.partial(jax.jit, static_argnames=("graphdef", "backend"), donate_argnames=("kv_cache",))
def run_body(graphdef: StaticGraph, state: dict, kv_cache: KVCache, input_ids: jax.Array,
             positions: jax.Array, metadata: AttentionMetadata, logits_indices: jax.Array, *,
             backend: str) -> tuple[jax.Array, KVCache]:
    """The model body over one step.

    Args:
      input_ids, positions: i32[T].
      metadata: slot_mapping i32[T], block_table i32[RA, MB], seq_lens
        i32[RA], query_start_loc i32[RA + 1].
      logits_indices: i32[RA], the token whose hidden state each sampling row
        needs (padding entries point anywhere in [0, T)).

    Returns:
      (hidden [RA, D] in the parameter dtype, updated kv_cache).
    """
    model = graphdef.merge(state)
    hidden, kv_cache = model(input_ids, positions, kv_cache, metadata, backend)  # [T, D]
    return hidden[logits_indices], kv_cache


@functools.partial(jax.jit, static_argnames=("graphdef",))
def run_sampler(graphdef: StaticGraph, state: dict, hidden: jax.Array,
                metadata: SamplingMetadata, server_key: jax.Array) -> SamplerOutput:
    """Logits of the first R rows of ``hidden`` [RA, D], then one token per row.

    R is the metadata's row count (the request bucket).
    """
    model = graphdef.merge(state)
    logits = model.logits(hidden[:metadata.num_rows])  # [R, V] f32
    with jax.named_scope("sampler"):  # scope name: benchmarks/step_profile.py
        return sample(logits, metadata, server_key)


@jax.jit
def gather_penalty_rows(prompt_mask: jax.Array, output_counts: jax.Array,
                        rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """bool[M, V], i32[M, V], rows i32[R] → (bool[R, V], i32[R, V])."""
    return prompt_mask[rows], output_counts[rows]


@functools.partial(jax.jit, donate_argnames=("output_counts",))
def add_output_counts(output_counts: jax.Array, rows: jax.Array,
                      token_ids: jax.Array) -> jax.Array:
    """Counts one sampled token per row: i32[M, V] (donated), rows i32[R] (M = padding, dropped)."""
    return output_counts.at[rows, token_ids].add(1, mode="drop")


@functools.partial(jax.jit, donate_argnames=("prompt_mask", "output_counts"))
def set_penalty_row(prompt_mask: jax.Array, output_counts: jax.Array, row: jax.Array,
                    mask_row: jax.Array, counts_row: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Writes one row's statistics (bool[V], i32[V]) into the donated [M, V] arrays."""
    return prompt_mask.at[row].set(mask_row), output_counts.at[row].set(counts_row)


@functools.partial(jax.jit, static_argnames=("num_rows", "vocab_size"))
def penalty_zeros(num_rows: int, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Device zeros (bool[R, V], i32[R, V]): steps without penalties, and the [M, V] state.

    Jitted with static shapes so that the warm-up compiles it (an eager
    ``jnp.zeros`` would compile on first use).
    """
    return (jnp.zeros((num_rows, vocab_size), bool), jnp.zeros((num_rows, vocab_size), jnp.int32))
