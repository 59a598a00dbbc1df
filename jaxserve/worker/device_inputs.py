"""The device half of a step: fixed-shape inputs built inside the jitted step.

From the packed buffer (``inputs.py``), the persistent block table and the
rows' last sampled tokens, ``step_inputs`` computes what the model body and
the sampler need, with no host round trip and no data-dependent control
flow (gathers, compares and cumulative sums only):

- ``query_start_loc`` i32[RA + 1]: the cumulative sum of ``num_tokens``;
- each token's row: the number of row ends at or before it (a compare
  against all RA ends, no search loop), so T × RA compares;
- ``positions`` i32[T] = the row's ``num_computed`` + the token's offset in
  the row's query; ``slot_mapping`` i32[T] through the block table, padding
  tokens to the null block;
- ``input_ids`` i32[T]: the buffer's id, or for -1 the row's last sampled
  token (device-side token feedback);
- ``seq_lens`` i32[RA] = ``num_computed + num_tokens``; the attention's block
  table ``[RA, MB]`` gathered from the persistent ``[M + 1, MB]`` one;
- for the sampler, compacted in plan order into M slots (so its shape does
  not depend on T): a sampling row's slots are its last ``sample`` query
  tokens (one, or 1 + its drafts: speculative decoding) — for each slot the
  token index, persistent row, position of the token it samples, the draft
  that sample is verified against and the row's first slot (M × RA compares
  find each slot's row).

Blocks appended this step are scattered into the persistent block table
first (``apply_appends``), so the step reads its own new blocks.

Shape legend: T tokens, RA attention rows, A appended blocks, M rows
(row M is padding), MB blocks per row, S block size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.kv_cache import NULL_BLOCK
from jaxserve.worker.inputs import StepLayout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleSlots:
    """Which rows sample after the body, compacted in plan order into M slots.

    Slots past the step's sampling rows are padding (row M, index 0).
    """

    logits_indices: jax.Array  # [M] i32 token whose hidden state each slot samples from
    rows: jax.Array  # [M] i32 persistent row of each slot
    positions: jax.Array  # [M] i32 position of the token each slot samples
    draft: jax.Array  # [M] i32 the draft its sample must equal for the row to go on, or -1
    start: jax.Array  # [M] i32 the row's first slot (sampler.verify_drafts)
    server_key: jax.Array  # [2] u32 (seed, step id): the key of unseeded rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The body's fixed-shape inputs for one step."""

    input_ids: jax.Array  # [T] i32
    positions: jax.Array  # [T] i32
    attention: AttentionMetadata  # slot_mapping [T], block_table [RA, MB], seq_lens [RA], qsl [RA + 1]
    slots: SampleSlots


def segment(buffer: jax.Array, layout: StepLayout, name: str) -> jax.Array:
    """One segment of the packed buffer (a static slice)."""
    return buffer[layout.segment(name)]


def apply_appends(block_table: jax.Array, buffer: jax.Array, layout: StepLayout) -> jax.Array:
    """The persistent block table i32[M + 1, MB] with this step's appended blocks written."""
    rows = segment(buffer, layout, "append_rows")  # [A]; M + 1 = padding, dropped
    return block_table.at[rows, segment(buffer, layout, "append_index")].set(
        segment(buffer, layout, "append_blocks"), mode="drop")


def step_inputs(buffer: jax.Array, block_table: jax.Array, last_token: jax.Array,
                layout: StepLayout, block_size: int) -> StepInputs:
    """Builds the step's inputs (see the module docstring).

    Args:
      buffer: i32[layout.size], the packed step.
      block_table: i32[M + 1, MB], appends already applied.
      last_token: i32[M + 1], each row's last sampled token.
      layout: the bucket's layout (static).
      block_size: S (static).
    """
    t, ra, m = layout.num_tokens, layout.num_rows, layout.max_num_seqs
    rows = segment(buffer, layout, "rows")  # [RA]
    computed = segment(buffer, layout, "num_computed")  # [RA]
    counts = segment(buffer, layout, "num_tokens")  # [RA]
    num_slots = segment(buffer, layout, "sample")  # [RA] 0, or 1 + the row's drafts
    ends = jnp.cumsum(counts)  # [RA]
    qsl = jnp.concatenate([jnp.zeros(1, jnp.int32), ends])  # [RA + 1]
    token = jnp.arange(t, dtype=jnp.int32)  # [T]
    tok_row = jnp.sum(ends[None, :] <= token[:, None], axis=1, dtype=jnp.int32)  # [T]
    real = tok_row < ra  # [T]; padding tokens lie past every row's end
    tok_row = jnp.minimum(tok_row, ra - 1)
    positions = jnp.where(real, computed[tok_row] + token - qsl[tok_row], 0)  # [T]
    persistent = rows[tok_row]  # [T]
    block = block_table[persistent, positions // block_size]  # [T]
    slot_mapping = jnp.where(real, block * block_size + positions % block_size,
                             NULL_BLOCK * block_size)
    ids = segment(buffer, layout, "input_ids")  # [T]
    input_ids = jnp.where(ids >= 0, ids, last_token[persistent])
    seq_lens = computed + counts  # [RA]
    attention = AttentionMetadata(slot_mapping=slot_mapping, block_table=block_table[rows],
                                  seq_lens=seq_lens, query_start_loc=qsl)
    # Sampling slots, compacted in plan order: a row's slots follow the rows before it.
    slot_ends = jnp.cumsum(num_slots)  # [RA]
    slot = jnp.arange(m, dtype=jnp.int32)  # [M]
    slot_row = jnp.sum(slot_ends[None, :] <= slot[:, None], axis=1, dtype=jnp.int32)  # [M]
    used = slot_row < ra  # [M]; padding slots lie past every row's slots
    slot_row = jnp.minimum(slot_row, ra - 1)
    first = slot_ends[slot_row] - num_slots[slot_row]  # [M] the row's first slot
    offset = slot - first  # [M] the slot's index in its row
    back = num_slots[slot_row] - offset  # [M] 1 at the row's last slot
    token_index = ends[slot_row] - back  # [M]
    draft = input_ids[jnp.minimum(token_index + 1, t - 1)]  # [M]
    slots = SampleSlots(
        logits_indices=jnp.where(used, token_index, 0),
        rows=jnp.where(used, rows[slot_row], m),
        positions=jnp.where(used, seq_lens[slot_row] - back + 1, 0),
        draft=jnp.where(used & (back > 1), draft, -1),
        start=jnp.where(used, first, slot),
        server_key=jax.lax.bitcast_convert_type(buffer[:2], jnp.uint32))
    return StepInputs(input_ids=input_ids, positions=positions, attention=attention,
                      slots=slots)
