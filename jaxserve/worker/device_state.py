"""The worker's persistent rows on the device, and their staged writes.

Everything a step reads about its rows lives on the device for the rows'
lifetime, so a steady step uploads only its packed buffer (``inputs.py``):

- ``DeviceRows``: the block table, the prompt lengths and ``min_tokens``
  (for the min-tokens bans), and every sampling parameter as per-row arrays;
  written from the host mirror (``rows.RowState``) by ``sync_rows`` when a
  row starts (or, rarely, when its appended blocks overflow a step's
  buffer), and extended by each step's appended blocks inside the body;
- ``last_token`` i32[M + 1]: each row's last sampled token, written by the
  sampler and read by the next step's body (device-side token feedback);
- ``PenaltyState``: the prompt mask and output counts, [M + 1, V], written
  per penalized new row by ``set_penalty_row`` and counted by the sampler
  variants that apply penalties.

Row M is the padding row: neutral parameters, never scheduled; scatters
aimed at M + 1 are dropped. Freed rows need no device write: a row is only
read while scheduled, and a new row overwrites everything it reads.

Shape legend: M rows, MB blocks per row, V vocab, r rows written (a request
bucket, padded with M + 1).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxserve.worker.rows import PARAM_FIELDS, RowState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceRows:
    """Per-row arrays, leading dimension M + 1 (or r in a staged write)."""

    block_table: jax.Array  # [M + 1, MB] i32, null-padded
    num_prompt_tokens: jax.Array  # [M + 1] i32
    min_tokens: jax.Array  # [M + 1] i32
    params: dict  # PARAM_FIELDS -> [M + 1, ...] (SamplingMetadata's per-row fields)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyState:
    """Token statistics of every row, for repetition / presence / frequency penalties."""

    prompt_mask: jax.Array  # [M + 1, V] bool
    output_counts: jax.Array  # [M + 1, V] i32


def host_rows(rows: RowState, index: np.ndarray | slice = slice(None)) -> DeviceRows:
    """``DeviceRows`` with NumPy leaves: the host mirror's rows ``index``."""
    return DeviceRows(block_table=rows.block_table[index],
                      num_prompt_tokens=rows.num_prompt_tokens[index],
                      min_tokens=rows.min_tokens[index],
                      params={f: rows.params[f][index] for f in PARAM_FIELDS})


@functools.partial(jax.jit, donate_argnames=("device_rows",))
def sync_rows(device_rows: DeviceRows, rows: jax.Array, values: DeviceRows) -> DeviceRows:
    """Writes whole rows: ``device_rows[rows[i]] = values[i]``.

    Args:
      device_rows: [M + 1, ...] leaves, donated (updated in place).
      rows: i32[r] row indices; M + 1 entries are padding (dropped).
      values: [r, ...] leaves.
    """
    return jax.tree.map(lambda full, part: full.at[rows].set(part, mode="drop"),
                        device_rows, values)


@functools.partial(jax.jit, donate_argnames=("penalty",))
def set_penalty_row(penalty: PenaltyState, row: jax.Array, mask_row: jax.Array,
                    counts_row: jax.Array) -> PenaltyState:
    """Writes one row's statistics (bool[V], i32[V]) into the donated [M + 1, V] arrays."""
    return PenaltyState(penalty.prompt_mask.at[row].set(mask_row),
                        penalty.output_counts.at[row].set(counts_row))
