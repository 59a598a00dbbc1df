"""The sampler: logits f32[R, V] + SamplingMetadata -> token ids and logprobs.

Every per-row parameter is an array, so one compiled variant serves any mix of
rows it covers. There is no data-dependent control flow (no ``lax.cond``, no
``while_loop``: on a GPU each would copy its predicate to the host and wait):
the stages a batch needs are picked on the host as a static ``variant``
(``variants.py``: GREEDY, SAMPLED, PROCESSED, FULL; ``choose_variant``), and
inside a variant every included stage runs for all rows, merged with
``jnp.where``.

Order of operations (vLLM V1's ``Sampler``), with the variant flag that
includes each stage:

0. the structured-output token bitmask: disallowed tokens -> -inf, before
   everything else, so every later stage and the logprobs see the masked
   distribution (``bitmask.py``)                                   [``mask``];
1. logit bias; min-tokens bans (EOS and stop ids -> -inf);
2. repetition / frequency / presence penalties       [1-2: ``processing``];
3. greedy rows (temperature < 1e-5): argmax of the result          [always];
4. random rows: z = logits / temperature, then min-p, top-k, top-p as one
   threshold (``top_k_top_p.py``) from the top-KC candidates   [``filters``],
   and the exact searches past them (fixed 32-step bisections)  [``search``];
5. Gumbel-max sampling (``gumbel.py``): among the top-KC candidates when the
   kept set lies inside them [``filters``], else two-level over the whole
   vocabulary [``random``: always computed; each row takes one of the two];
6. logprobs: ``log_softmax`` of the raw logits (default, as vLLM V1) or of the
   processed distribution (``logprobs_mode="processed"``: the z actually
   sampled from with filtered tokens at -inf; greedy rows: step 2's logits
   at temperature 1, unfiltered)                                [``logprobs``].

A row's tokens and logprobs are the same under every variant that covers it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxserve.worker.sampler.bitmask import apply_token_bitmask
from jaxserve.worker.sampler.gumbel import gumbel_max_candidates, gumbel_max_full, row_keys
from jaxserve.worker.sampler.logprobs import token_logprobs
from jaxserve.worker.sampler.metadata import SamplingMetadata, is_greedy
from jaxserve.worker.sampler.penalties import (apply_banned_tokens, apply_logit_bias,
                                               apply_penalties)
from jaxserve.worker.sampler.top_k_top_p import NUM_CANDIDATES, filter_threshold, needs_filter
from jaxserve.worker.sampler.variants import FULL, SamplerVariant


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


@functools.partial(jax.jit, static_argnames=("variant", "num_candidates"))
def sample(logits: jax.Array, metadata: SamplingMetadata, server_key: jax.Array,
           token_bitmask: jax.Array | None = None, *, variant: SamplerVariant = FULL,
           num_candidates: int = NUM_CANDIDATES) -> SamplerOutput:
    """Samples one token per row.

    Args:
      logits: f32[R, V] (other float dtypes are widened to f32).
      metadata: ``SamplingMetadata`` for R rows over the same V.
      server_key: threefry key (typed, or raw u32[2]) for unseeded rows; pass
        a fresh one each step (e.g. ``jax.random.fold_in(base, step)``).
      token_bitmask: i32[R, ceil(V / 32)], the allowed tokens per row
        (``bitmask.py``), in variants with ``mask``; else None.
      variant: static; the stages compiled in (default FULL, exact for every
        unconstrained row). Results are exact only for rows the variant covers
        (``choose_variant`` picks one that covers every row).
      num_candidates: static KC, the top-k fast-path width (tests lower it).

    Returns:
      SamplerOutput.

    Raises:
      ValueError: at trace time, when the shapes of ``logits`` and
        ``metadata`` (or ``token_bitmask``) disagree, or ``token_bitmask`` is
        missing in a ``mask`` variant (or given in another).
    """
    m = metadata
    rows, vocab = logits.shape
    if m.prompt_mask.shape != (rows, vocab) or m.temperature.shape != (rows,):
        raise ValueError(f"logits {logits.shape} and metadata (R={m.num_rows}, "
                         f"V={m.vocab_size}) disagree")
    if variant.mask != (token_bitmask is not None):
        raise ValueError(f"token_bitmask must be given exactly in mask variants ({variant})")
    raw = logits.astype(jnp.float32)  # [R, V]
    if variant.mask:
        raw = apply_token_bitmask(raw, token_bitmask)  # [R, V]: disallowed at -inf
    processed = process_logits(raw, m) if variant.processing else raw  # [R, V] f32
    greedy = is_greedy(m.temperature)  # [R] bool
    temperature = jnp.where(greedy, 1.0, m.temperature)  # [R] f32
    argmax = jnp.argmax(processed, axis=-1).astype(jnp.int32)  # [R]: the first max, or first NaN
    threshold = jnp.full((rows,), -jnp.inf, jnp.float32)  # [R] in z units
    token_ids = argmax
    if variant.random:
        keys = row_keys(m.seeds, m.seeded, m.positions, server_key)  # [R] key
        in_candidates = jnp.zeros((rows,), bool)
        picked = argmax
        if variant.filters:
            kc = min(num_candidates, vocab)
            filtered = needs_filter(m.top_k, m.top_p, m.min_p, ~greedy, vocab)  # [R] bool
            threshold, cand_z, cand_ids = filter_threshold(
                processed, temperature, m.top_k, m.top_p, m.min_p, filtered, kc,
                search=variant.search)
            in_candidates = filtered & ((threshold > cand_z[:, -1]) | (kc == vocab))
            pick = gumbel_max_candidates(keys, cand_z, threshold)  # [R] i32
            picked = jnp.take_along_axis(cand_ids, pick[:, None], axis=-1)[:, 0]
        drawn = gumbel_max_full(keys, processed, temperature, threshold)  # [R] i32
        token_ids = jnp.where(greedy, argmax, jnp.where(in_candidates, picked, drawn))
    fields = _logprobs(token_ids, raw, processed, temperature, threshold, m, variant.logprobs)
    return SamplerOutput(token_ids, *fields)


def _logprobs(token_ids: jax.Array, raw: jax.Array, processed: jax.Array,
              temperature: jax.Array, threshold: jax.Array, m: SamplingMetadata,
              enabled: bool) -> tuple[jax.Array, ...]:
    """Step 6: (logprob, rank, top_logprobs, top_token_ids) of SamplerOutput."""
    rows = token_ids.shape[0]
    nl = m.max_num_logprobs
    if not enabled:  # the values token_logprobs gives rows with num_logprobs = -1
        return (jnp.full((rows,), jnp.nan, jnp.float32), jnp.full((rows,), -1, jnp.int32),
                jnp.full((rows, nl), -jnp.inf, jnp.float32), jnp.full((rows, nl), -1, jnp.int32))
    if m.logprobs_mode == "raw":
        source = raw
    else:
        z = processed / temperature[:, None]  # [R, V]
        source = jnp.where(z >= threshold[:, None], z, -jnp.inf)
    return token_logprobs(source, token_ids, m.num_logprobs, nl)
