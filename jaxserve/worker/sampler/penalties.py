"""Logit bias, min-tokens bans and the three penalties (vLLM's order).

vLLM V1 applies, before temperature: the logit bias and the min-tokens bans
(its non-argmax-invariant logits processors), then the repetition, frequency
and presence penalties (``vllm/model_executor/layers/utils.py``
``apply_penalties``). Greedy rows take the argmax after all of these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_logit_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """Adds sparse per-row biases.

    Args:
      logits: f32[R, V].
      ids: i32[R, NB] token ids, -1 = padding (ids must be unique per row).
      values: f32[R, NB] added to ``logits[r, ids[r, j]]``.

    Returns:
      f32[R, V].
    """
    rows, vocab = logits.shape
    safe = jnp.where(ids < 0, vocab, ids)  # [R, NB] i32; vocab -> dropped
    return logits.at[jnp.arange(rows)[:, None], safe].add(values, mode="drop")


def apply_banned_tokens(logits: jax.Array, ids: jax.Array, active: jax.Array) -> jax.Array:
    """Sets banned tokens' logits to -inf in the active rows (min_tokens).

    Args:
      logits: f32[R, V].
      ids: i32[R, NE] EOS / stop token ids, -1 = padding.
      active: bool[R], rows that have not yet generated ``min_tokens``.

    Returns:
      f32[R, V].
    """
    rows, vocab = logits.shape
    safe = jnp.where((ids < 0) | ~active[:, None], vocab, ids)  # [R, NE] i32
    return logits.at[jnp.arange(rows)[:, None], safe].set(-jnp.inf, mode="drop")


def apply_penalties(logits: jax.Array, prompt_mask: jax.Array, output_counts: jax.Array,
                    repetition_penalty: jax.Array, presence_penalty: jax.Array,
                    frequency_penalty: jax.Array) -> jax.Array:
    """Repetition, frequency and presence penalties, as vLLM V1.

    For tokens seen in the prompt or output, the repetition penalty divides
    positive logits and multiplies the others (CTRL, Keskar et al. 2019);
    then ``frequency_penalty * count`` and ``presence_penalty * (count > 0)``
    are subtracted for output tokens (OpenAI's definition). Rows with
    penalties (1, 0, 0) are left bit-exactly unchanged.

    Args:
      logits: f32[R, V].
      prompt_mask: bool[R, V].
      output_counts: i32[R, V].
      repetition_penalty, presence_penalty, frequency_penalty: f32[R].

    Returns:
      f32[R, V].
    """
    seen_output = output_counts > 0  # [R, V] bool
    rep = jnp.where(prompt_mask | seen_output, repetition_penalty[:, None], 1.0)  # [R, V]
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency_penalty[:, None] * output_counts.astype(jnp.float32)
    return logits - presence_penalty[:, None] * seen_output.astype(jnp.float32)

