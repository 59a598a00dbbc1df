"""Logprobs of the sampled token, its rank, and the top-N tokens.

Logprobs are ``log_softmax`` of one row of logits with -inf for excluded
tokens. Which logits is the caller's choice (``SamplingMetadata.logprobs_mode``):
the raw model logits (vLLM V1's default, ``raw_logprobs``) or the processed
ones actually sampled from. The same function serves prompt logprobs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.worker.sampler.top_k import exact_top_k


def token_logprobs(logits: jax.Array, token_ids: jax.Array, num_logprobs: jax.Array,
                   max_num_logprobs: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """log_softmax(logits) at the given tokens, their rank, and the top N.

    Args:
      logits: f32[R, V], -inf allowed (excluded tokens; not all of a row).
      token_ids: i32[R], the sampled (or prompt) token per row.
      num_logprobs: i32[R]; -1 = row wants none (outputs NaN / -1), else N.
      max_num_logprobs: static NL >= max(num_logprobs).

    Returns:
      logprob: f32[R], NaN where num_logprobs < 0.
      rank: i32[R], 1 + number of tokens with a strictly larger logit (vLLM's
        rank), -1 where num_logprobs < 0.
      top_logprobs: f32[R, NL], descending; -inf in slots >= num_logprobs.
      top_token_ids: i32[R, NL] (ties: lower id first); -1 in unused slots.
    """
    rows = logits.shape[0]
    chosen = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)  # [R, 1]
    row_max = jnp.max(logits, axis=-1, keepdims=True)  # [R, 1]
    # One pass for both sums (two separate reductions cost two passes on CPU).
    mass, above = lax.reduce(
        (jnp.exp(logits - row_max), (logits > chosen).astype(jnp.int32)),
        (jnp.float32(0), jnp.int32(0)),
        lambda a, b: (a[0] + b[0], a[1] + b[1]), (1,))  # [R] f32, [R] i32
    lse = row_max[:, 0] + jnp.log(mass)  # [R]
    wanted = num_logprobs >= 0
    logprob = jnp.where(wanted, chosen[:, 0] - lse, jnp.nan)
    rank = jnp.where(wanted, 1 + above, -1)
    if max_num_logprobs == 0:
        return (logprob, rank, jnp.zeros((rows, 0), jnp.float32),
                jnp.zeros((rows, 0), jnp.int32))
    top_vals, top_ids = exact_top_k(logits, max_num_logprobs)  # [R, NL]; no sort of V on a GPU
    used = jnp.arange(max_num_logprobs)[None, :] < num_logprobs[:, None]  # [R, NL]
    top_logprobs = jnp.where(used, top_vals - lse[:, None], -jnp.inf)
    return logprob, rank, top_logprobs, jnp.where(used, top_ids, -1)
