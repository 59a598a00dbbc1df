"""The step's jitted executables: the body keyed on T, logits + sampler keyed on (R, variant).

This is the one implementation of the model step; the server, the parity
tests and the benchmarks all run it.

- ``run_body``: applies the step's appended blocks to the persistent block
  table, builds the step's inputs on the device (``device_inputs``), runs
  every layer over the T tokens, and gathers the final hidden state of
  each sampling row's last token into M fixed slots (so the sampler's
  shapes do not depend on T); it also returns every token's final hidden
  state [T, D] (the model computes it for every token anyway; a step
  without prompt-logprob rows drops it). The KV cache and the block table
  are donated (updated in place).
- ``run_sampler``: the LM head over the first R slots, the sampling
  parameters gathered from the persistent rows, and the sampler
  (``jaxserve.worker.sampler.sample``) in the variant the host chose; a row
  with draft tokens keeps its accepted drafts and the token after them
  (``sampler.verify_drafts``); then each row's last kept token becomes its
  ``last_token`` (donated) and, in variants that apply penalties, its kept
  tokens are counted in ``output_counts`` (donated).
- ``run_prompt_logprobs``: keyed on T, run only in steps with prompt-logprob
  rows: the LM head over the body's [T, D] states, in chunks of at most
  ``PROMPT_LOGPROBS_CHUNK`` tokens, and for every token the logprob (from the
  raw logits, as vLLM) of the prompt token that follows it, its rank and the
  top ``MAX_LOGPROBS`` (``sampler.token_logprobs``, the sampler's own).
- ``run_body_logits``: the same body with the logits of every token (the
  model parity tests compare them with transformers).
- ``run_draft_proposals``: keyed on R, run only with a draft model
  (speculative decoding, ``method="draft_model"``): after ``run_sampler``,
  the draft model (whose KV cache ``run_body`` filled for this step's query
  tokens, in the same blocks as the target's) decodes k greedy tokens after
  each sampling row's new last token: the row's drafts for its next step.

So the step executables number 2 × |T ladder| + |R ladder| × |variants|, not a
product with T; ``executables`` says which are compiled at start-up and which
in the background after.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.graph import StaticGraph
from jaxserve.model.kv_cache import NULL_BLOCK, KVCache
from jaxserve.model.sharding import on_every_device
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.worker.device_inputs import SampleSlots, apply_appends, step_inputs
from jaxserve.worker.device_state import DeviceRows
from jaxserve.worker.inputs import StepLayout
from jaxserve.worker.rows import PARAM_FIELDS
from jaxserve.worker.sampler import (SamplerOutput, SamplerVariant, SamplingMetadata,
                                     count_earlier_drafts, sample, token_logprobs,
                                     verify_drafts)


def _body(graphdef: StaticGraph, state: dict, kv_cache: KVCache, block_table: jax.Array,
          last_token: jax.Array, buffer: jax.Array, layout: StepLayout, backend: str):
    block_table = apply_appends(block_table, buffer, layout)
    inputs = step_inputs(buffer, block_table, last_token, layout, kv_cache.block_size)
    model = graphdef.merge(state)
    hidden, kv_cache = model(inputs.input_ids, inputs.positions, kv_cache, inputs.attention,
                             backend)  # [T, D]
    return model, hidden, kv_cache, block_table, inputs.slots


@functools.partial(jax.jit, static_argnames=("graphdef", "layout", "backend"),
                   donate_argnames=("kv_cache", "block_table"))
def run_body(graphdef: StaticGraph, state: dict, kv_cache: KVCache, block_table: jax.Array,
             last_token: jax.Array, buffer: jax.Array, *, layout: StepLayout, backend: str
             ) -> tuple[KVCache, jax.Array, jax.Array, SampleSlots]:
    """The model body over one step.

    Args:
      graphdef, state: the split model (``load_model``).
      kv_cache: the paged cache, donated.
      block_table: i32[M + 1, MB], the persistent block table, donated.
      last_token: i32[M + 1], each row's last sampled token.
      buffer: i32[layout.size], the packed step (``inputs.pack``).
      layout: the T bucket's layout (static).
      backend: attention backend (``jaxserve.model.attention.ATTENTION_BACKENDS``).

    Returns:
      (kv_cache, block_table, hidden [M, D] in the parameter dtype — slot j
      holds the j-th sampling row's last token's state, slots, every token's
      hidden state [T, D] for ``run_prompt_logprobs``)
    """
    _, hidden, kv_cache, block_table, slots = _body(graphdef, state, kv_cache, block_table,
                                                    last_token, buffer, layout, backend)
    return kv_cache, block_table, hidden[slots.logits_indices], slots, hidden


# Most tokens whose logits [C, V] f32 one chunk of ``run_prompt_logprobs`` holds.
PROMPT_LOGPROBS_CHUNK = 512


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """``run_prompt_logprobs``'s output: one entry per token of the step.

    Entry t is about the token that follows token t in its row's prompt;
    entries of tokens that asked for none hold NaN / -1 / -inf / -1.
    """

    logprob: jax.Array  # [T] f32 that token's logprob
    rank: jax.Array  # [T] i32 its rank, 1 = most likely
    top_logprobs: jax.Array  # [T, NL] f32 descending; -inf past the row's N
    top_token_ids: jax.Array  # [T, NL] i32; -1 past the row's N


@functools.partial(jax.jit, static_argnames=("graphdef",))
def run_prompt_logprobs(graphdef: StaticGraph, state: dict, hidden: jax.Array,
                        targets: jax.Array) -> PromptLogprobs:
    """Prompt logprobs of one step's tokens, from ``run_body``'s hidden states.

    Args:
      graphdef, state: the split model.
      hidden: [T, D], every token's final hidden state (``run_body``'s last output).
      targets: i32[2, T]: row 0 the prompt token that follows each token (any
        id in [0, V) where not asked), row 1 how many top logprobs each token
        asks for (-1 = none, else N <= ``MAX_LOGPROBS``).

    Returns:
      ``PromptLogprobs`` over the T tokens, NL = ``MAX_LOGPROBS``.
    """
    model = graphdef.merge(state)
    t = hidden.shape[0]
    parts = []
    for start in range(0, t, PROMPT_LOGPROBS_CHUNK):  # unrolled: no loop in the executable
        end = min(start + PROMPT_LOGPROBS_CHUNK, t)
        logits = model.logits(hidden[start:end])  # [C, V] f32
        parts.append(token_logprobs(logits, targets[0, start:end], targets[1, start:end],
                                    MAX_LOGPROBS))
    return PromptLogprobs(*(jnp.concatenate(p) if len(parts) > 1 else p[0]
                            for p in zip(*parts)))


@functools.partial(jax.jit, static_argnames=("graphdef", "layout", "backend"),
                   donate_argnames=("kv_cache", "block_table"))
def run_body_logits(graphdef: StaticGraph, state: dict, kv_cache: KVCache,
                    block_table: jax.Array, last_token: jax.Array, buffer: jax.Array, *,
                    layout: StepLayout, backend: str) -> tuple[jax.Array, KVCache, jax.Array]:
    """``run_body`` returning every token's logits f32[T, V] (padding tokens included)."""
    model, hidden, kv_cache, block_table, _ = _body(graphdef, state, kv_cache, block_table,
                                                    last_token, buffer, layout, backend)
    return model.logits(hidden), kv_cache, block_table


@functools.partial(jax.jit, static_argnames=("graphdef", "num_reqs", "variant"),
                   donate_argnames=("last_token", "output_counts"))
def run_sampler(graphdef: StaticGraph, state: dict, hidden: jax.Array, slots: SampleSlots,
                device_rows: DeviceRows, last_token: jax.Array, prompt_mask: jax.Array | None,
                output_counts: jax.Array | None, token_bitmask: jax.Array | None = None, *,
                num_reqs: int, variant: SamplerVariant
                ) -> tuple[SamplerOutput, jax.Array, jax.Array, jax.Array | None]:
    """Logits of the first R slots, then one token per slot, verified against the drafts.

    Args:
      hidden: [M, D], ``run_body``'s gathered states; slots: its ``SampleSlots``.
      device_rows: the persistent rows ([M + 1, ...]).
      last_token: i32[M + 1], donated.
      prompt_mask, output_counts: bool / i32[M + 1, V] (``output_counts``
        donated) in variants that apply penalties, else None.
      token_bitmask: i32[R, ceil(V / 32)] allowed tokens per slot in the
        masked variants (structured outputs; uploaded with the step's buffer),
        else None.
      num_reqs: R, the request bucket (static).
      variant: the sampler variant (static; ``jaxserve.worker.sampler``).

    Returns:
      (SamplerOutput for R slots, kept bool[R] — the slots whose tokens their
      rows keep (``verify_drafts``), last_token, output_counts or None)
    """
    r = num_reqs
    rows = slots.rows[:r]  # [R]; padding slots hold row M
    positions = slots.positions[:r]  # [R]
    draft, start = slots.draft[:r], slots.start[:r]  # [R]
    model = graphdef.merge(state)
    logits = model.logits(hidden[:r])  # [R, V] f32
    vocab = logits.shape[1]
    if output_counts is None:
        mask, counts = jnp.zeros((r, vocab), bool), jnp.zeros((r, vocab), jnp.int32)
    else:
        mask = prompt_mask[rows]
        counts = count_earlier_drafts(output_counts[rows], draft, start)
    metadata = SamplingMetadata(
        positions=positions,
        ban_active=positions - device_rows.num_prompt_tokens[rows] < device_rows.min_tokens[rows],
        prompt_mask=mask, output_counts=counts, max_num_logprobs=MAX_LOGPROBS,
        **{f: device_rows.params[f][rows] for f in PARAM_FIELDS})
    with jax.named_scope("sampler"):  # scope name: benchmarks/step_profile.py
        # With tensor parallelism every device draws the same tokens from full rows.
        out = on_every_device(functools.partial(sample, variant=variant), model.mesh)(
            logits, metadata, slots.server_key, token_bitmask)
    kept, last = verify_drafts(out.token_ids, draft, start)
    dropped = last_token.shape[0]  # M + 1: out of range, the scatter drops it
    last_token = last_token.at[jnp.where(last, rows, dropped)].set(out.token_ids, mode="drop")
    if output_counts is not None:
        output_counts = output_counts.at[jnp.where(kept, rows, dropped), out.token_ids].add(
            1, mode="drop")
    return out, kept, last_token, output_counts


@functools.partial(jax.jit, static_argnames=("graphdef", "num_reqs", "num_speculative_tokens",
                                             "backend"),
                   donate_argnames=("kv_cache",))
def run_draft_proposals(graphdef: StaticGraph, state: dict, kv_cache: KVCache,
                        block_table: jax.Array, last_token: jax.Array, slots: SampleSlots,
                        kept: jax.Array, *, num_reqs: int, num_speculative_tokens: int,
                        backend: str) -> tuple[KVCache, jax.Array]:
    """The draft model's k greedy tokens after each sampling row's new last token.

    Runs after ``run_sampler``. A row's new last token (the token after its
    accepted drafts) lies at the position its last kept slot sampled for, q;
    iteration i feeds the token at q + i (the new last token, then the
    previous iteration's draft) through the draft model as a one-token query
    — writing its keys and values at q + i — and takes the argmax of its
    logits. The draft model's cache already holds every earlier position:
    ``run_body`` ran it over this step's query tokens (a rejected draft's
    slot is written again here or later). Positions past the row's blocks
    write to the null block (the scheduler allocates k tokens ahead, so only
    a full cache leaves them without), which only makes those drafts worse:
    the verify step keeps a draft only where the target model agrees.

    Args:
      graphdef, state: the draft model (split).
      kv_cache: the draft model's paged cache (same blocks and block size as
        the target's), donated.
      block_table: i32[M + 1, MB], the persistent block table (after the step's appends).
      last_token: i32[M + 1], each row's last token (after ``run_sampler``).
      slots: the body's ``SampleSlots`` (for the draft model's body or the target's:
        the same).
      kept: bool[R], ``run_sampler``'s kept slots.
      num_reqs: R (static); num_speculative_tokens: k (static).
      backend: the attention backend (static).

    Returns:
      (kv_cache, drafts i32[R, k]): a row's drafts at its first slot's index
      (``slots.start``); other entries -1.
    """
    r, k = num_reqs, num_speculative_tokens
    mb = block_table.shape[1]
    m = block_table.shape[0] - 1
    start = slots.start[:r]  # [R]
    slot = jnp.arange(r, dtype=jnp.int32)
    same_row_next = jnp.roll(kept, -1) & (jnp.roll(start, -1) == start) & (slot < r - 1)
    last = kept & ~same_row_next & (slots.rows[:r] < m)  # [R] the row's last kept slot
    rows = jnp.where(last, slots.rows[:r], m)  # [R]; others read the padding row
    first = slots.positions[:r]  # [R] q: where the row's new last token lies
    table = block_table[rows]  # [R, MB]
    size = kv_cache.block_size
    model = graphdef.merge(state)

    def step(i, carry):
        kv, token, drafts = carry
        position = jnp.where(last, first + i, 0)  # [R]
        inside = last & (position < mb * size)
        block = table[slot, jnp.minimum(position // size, mb - 1)]
        attention = AttentionMetadata(
            slot_mapping=jnp.where(inside, block * size + position % size, NULL_BLOCK * size),
            block_table=table, seq_lens=jnp.where(inside, position + 1, 1),
            query_start_loc=jnp.arange(r + 1, dtype=jnp.int32))
        hidden, kv = model(token, position, kv, attention, backend)  # [R, D]
        token = jnp.argmax(model.logits(hidden), axis=-1).astype(jnp.int32)  # [R]
        return kv, token, drafts.at[:, i].set(token)

    drafts = jnp.full((r, k), -1, jnp.int32)
    kv_cache, _, drafts = jax.lax.fori_loop(0, k, step, (kv_cache, last_token[rows], drafts))
    out = jnp.full((r, k), -1, jnp.int32).at[jnp.where(last, start, r)].set(drafts, mode="drop")
    return kv_cache, out
