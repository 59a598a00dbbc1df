"""The sampler: logits f32[R, V] + SamplingMetadata -> token ids and logprobs.

One jitted function serves any mix of rows: every parameter is an array, and
the expensive stages run under ``lax.cond`` only when some row needs them, so
a greedy or plain-temperature batch stays cheap without a second executable.

Order of operations (vLLM V1's ``Sampler``):

1. logit bias; min-tokens bans (EOS and stop ids -> -inf);
2. repetition / frequency / presence penalties
                                   [1-2: cond: any row biased, banned or penalized];
3. greedy rows (temperature < 1e-5): argmax of the result;
4. random rows: z = logits / temperature, then min-p, top-k, top-p as one
   threshold (``top_k_top_p.py``)                  [cond: any row filtered];
5. Gumbel-max sampling (``gumbel.py``): among the top-KC candidates when the
   kept set lies inside them, else two-level over the whole vocabulary
                                                   [cond: any such row];
6. logprobs: ``log_softmax`` of the raw logits (default, as vLLM V1) or of the
   processed distribution (``logprobs_mode="processed"``: the z actually
   sampled from with filtered tokens at -inf; greedy rows: step 2's logits
   at temperature 1, unfiltered)                   [cond: any row asks].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.worker.sampler.gumbel import gumbel_max_candidates, gumbel_max_full, row_keys
from jaxserve.worker.sampler.logprobs import token_logprobs
from jaxserve.worker.sampler.metadata import SamplingMetadata, is_greedy
from jaxserve.worker.sampler.penalties import (any_penalty, apply_banned_tokens,
                                               apply_logit_bias, apply_penalties)
from jaxserve.worker.sampler.top_k_top_p import NUM_CANDIDATES, filter_threshold, needs_filter


@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """What ``sample`` returns for R rows (a pytree).

    Attributes:
      token_ids: i32[R], the sampled tokens.
      logprob: f32[R], the sampled token's logprob (see ``logprobs_mode``);
        NaN in rows that asked for no logprobs (num_logprobs = -1).
      rank: i32[R], the sampled token's rank in that distribution (1 = most
        likely); -1 in rows without logprobs.
      top_logprobs: f32[R, NL], top logprobs, descending; -inf past the row's
        num_logprobs.
      top_token_ids: i32[R, NL], their token ids; -1 past num_logprobs.
    """

    token_ids: jax.Array  # [R] i32
    logprob: jax.Array  # [R] f32
    rank: jax.Array  # [R] i32
    top_logprobs: jax.Array  # [R, NL] f32
    top_token_ids: jax.Array  # [R, NL] i32


jax.tree_util.register_dataclass(
    SamplerOutput, data_fields=["token_ids", "logprob", "rank", "top_logprobs",
                                "top_token_ids"], meta_fields=[])


def process_logits(logits: jax.Array, metadata: SamplingMetadata) -> jax.Array:
    """Steps 1-2: f32[R, V] logits after bias, min-tokens bans and penalties."""
    m = metadata
    out = apply_logit_bias(logits.astype(jnp.float32), m.logit_bias_ids, m.logit_bias_values)
    out = apply_banned_tokens(out, m.banned_ids, m.ban_active)
    return apply_penalties(out, m.prompt_mask, m.output_counts, m.repetition_penalty,
                           m.presence_penalty, m.frequency_penalty)


def needs_processing(metadata: SamplingMetadata) -> jax.Array:
    """bool[]: does any row have a logit bias, an active ban or a penalty."""
    m = metadata
    return (jnp.any(m.logit_bias_ids >= 0)
            | jnp.any(m.ban_active[:, None] & (m.banned_ids >= 0))
            | any_penalty(m.repetition_penalty, m.presence_penalty, m.frequency_penalty))


@functools.partial(jax.jit, static_argnames=("num_candidates",))
def sample(logits: jax.Array, metadata: SamplingMetadata, server_key: jax.Array, *,
           num_candidates: int = NUM_CANDIDATES) -> SamplerOutput:
    """Samples one token per row.

    Args:
      logits: f32[R, V] (other float dtypes are widened to f32).
      metadata: ``SamplingMetadata`` for R rows over the same V.
      server_key: threefry key (typed, or raw u32[2]) for unseeded rows; pass
        a fresh one each step (e.g. ``jax.random.fold_in(base, step)``).
      num_candidates: static KC, the top-k fast-path width (tests lower it).

    Returns:
      SamplerOutput.

    Raises:
      ValueError: at trace time, when the shapes of ``logits`` and
        ``metadata`` disagree.
    """
    m = metadata
    rows, vocab = logits.shape
    if m.prompt_mask.shape != (rows, vocab) or m.temperature.shape != (rows,):
        raise ValueError(f"logits {logits.shape} and metadata (R={m.num_rows}, "
                         f"V={m.vocab_size}) disagree")
    raw = logits.astype(jnp.float32)  # [R, V]
    keys = row_keys(m.seeds, m.seeded, m.positions, server_key)  # [R] key
    tail = functools.partial(_sample_processed, raw=raw, keys=keys, m=m,
                             num_candidates=num_candidates)
    # The rest of the sampler is traced in both branches: a cond whose branch
    # returns its [R, V] operand unchanged would copy it (~R * V * 4 bytes).
    fields = lax.cond(needs_processing(m), lambda x: tail(process_logits(x, m)), tail, raw)
    return SamplerOutput(*fields)


def _sample_processed(processed: jax.Array, *, raw: jax.Array, keys: jax.Array,
                      m: SamplingMetadata, num_candidates: int) -> tuple[jax.Array, ...]:
    """Steps 3-6 on processed logits f32[R, V]; returns SamplerOutput's fields."""
    rows, vocab = processed.shape
    greedy = is_greedy(m.temperature)  # [R] bool
    temperature = jnp.where(greedy, 1.0, m.temperature)  # [R] f32
    filtered = needs_filter(m.top_k, m.top_p, m.min_p, ~greedy, vocab)  # [R] bool
    kc = min(num_candidates, vocab)

    def with_filters(x: jax.Array) -> tuple[jax.Array, ...]:
        threshold, cand_z, cand_ids = filter_threshold(
            x, temperature, m.top_k, m.top_p, m.min_p, filtered, kc)
        in_candidates = filtered & ((threshold > cand_z[:, -1]) | (kc == vocab))
        pick = gumbel_max_candidates(keys, cand_z, threshold)  # [R] i32
        picked = jnp.take_along_axis(cand_ids, pick[:, None], axis=-1)[:, 0]
        return threshold, cand_ids[:, 0], in_candidates, picked

    def without_filters(x: jax.Array) -> tuple[jax.Array, ...]:
        argmax = lax.cond(jnp.any(greedy), lambda y: lax.top_k(y, 1)[1][:, 0],
                          lambda y: jnp.zeros((rows,), jnp.int32), x)
        return (jnp.full((rows,), -jnp.inf, jnp.float32), argmax,
                jnp.zeros((rows,), bool), jnp.zeros((rows,), jnp.int32))

    threshold, argmax, in_candidates, picked = lax.cond(
        jnp.any(filtered), with_filters, without_filters, processed)
    full_rows = ~greedy & ~in_candidates
    drawn = lax.cond(
        jnp.any(full_rows),
        lambda x: gumbel_max_full(keys, x, temperature, threshold),
        lambda x: jnp.zeros((rows,), jnp.int32), processed)
    token_ids = jnp.where(greedy, argmax, jnp.where(in_candidates, picked, drawn))
    return _with_logprobs(token_ids, raw, processed, temperature, threshold, m)


def _with_logprobs(token_ids: jax.Array, raw: jax.Array, processed: jax.Array,
                   temperature: jax.Array, threshold: jax.Array,
                   m: SamplingMetadata) -> tuple[jax.Array, ...]:
    rows = token_ids.shape[0]
    nl = m.max_num_logprobs

    def compute(_: jax.Array) -> tuple[jax.Array, ...]:
        if m.logprobs_mode == "raw":
            source = raw
        else:
            z = processed / temperature[:, None]
            source = jnp.where(z >= threshold[:, None], z, -jnp.inf)
        return token_logprobs(source, token_ids, m.num_logprobs, nl)

    def skip(_: jax.Array) -> tuple[jax.Array, ...]:
        return (jnp.full((rows,), jnp.nan, jnp.float32), jnp.full((rows,), -1, jnp.int32),
                jnp.full((rows, nl), -jnp.inf, jnp.float32), jnp.full((rows, nl), -1, jnp.int32))

    logprob, rank, top_logprobs, top_ids = lax.cond(
        jnp.any(m.num_logprobs >= 0), compute, skip, token_ids)
    return token_ids, logprob, rank, top_logprobs, top_ids
