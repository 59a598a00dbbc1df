"""Host-side (NumPy) construction of one step's fixed-shape inputs from rows + schedule.

``prepare_body_inputs`` lays the scheduled rows' query tokens out in token
order and pads everything to the bucket: T tokens, and a fixed RA attention
rows (``max_num_seqs``) so the model body is keyed on T alone. Padding
tokens have id 0, position 0 and a slot in the null block; padding rows
have ``seq_len`` 0 and a null block table. ``prepare_sampling`` gathers the
sampling rows' parameters, padded to R with the neutral padding row.

Shape legend: T token bucket, RA attention rows, MB blocks per row, R
request bucket, n scheduled rows, s sampling rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.step_plan import StepPlan
from jaxserve.worker.rows import PARAM_FIELDS, RowState
from jaxserve.worker.sampler import SamplingMetadata

NULL_BLOCK = 0


@dataclasses.dataclass(frozen=True)
class BodyInputs:
    """NumPy inputs of the model body for one step."""

    input_ids: np.ndarray  # [T] i32
    positions: np.ndarray  # [T] i32
    slot_mapping: np.ndarray  # [T] i32, padding -> null block
    block_table: np.ndarray  # [RA, MB] i32, padding rows -> null block
    seq_lens: np.ndarray  # [RA] i32, padding rows 0
    query_start_loc: np.ndarray  # [RA + 1] i32
    logits_indices: np.ndarray  # [RA] i32 last token of each sampling row, padding 0
    sample_rows: np.ndarray  # [s] i32 persistent rows that sample, in plan order


def prepare_body_inputs(rows: RowState, plan: StepPlan, num_attention_rows: int) -> BodyInputs:
    """Builds the body's inputs for ``plan`` (diffs already applied to ``rows``).

    Raises:
      ValueError: a scheduled row is not in use, lacks the tokens or blocks
        its query needs, samples before computing all its tokens, or the step
        does not fit the bucket.
    """
    r, c, n = plan.rows, plan.num_computed, plan.num_tokens
    k, t_bucket, s = len(r), plan.num_tokens_bucket, rows.block_size
    total = int(n.sum())
    end = c + n  # [n]
    if k > num_attention_rows or total > t_bucket:
        raise ValueError(f"{k} rows / {total} tokens exceed {num_attention_rows} / {t_bucket}")
    if k and (not rows.in_use[r].all() or (end > rows.num_tokens[r]).any()
              or (end > rows.num_blocks[r] * s).any() or (n < 1).any()):
        raise ValueError(f"step {plan.step_id}: rows {r.tolist()} lack tokens or blocks for "
                         f"num_computed {c.tolist()} + num_tokens {n.tolist()}")
    if (plan.sample & (end != rows.num_tokens[r])).any():
        raise ValueError(f"step {plan.step_id}: a row samples before computing all its tokens")
    qsl = np.zeros(num_attention_rows + 1, np.int32)
    np.cumsum(n, out=qsl[1:k + 1])
    qsl[k + 1:] = total
    tok_row = np.repeat(r, n)  # [total]
    pos = np.arange(total, dtype=np.int32) + np.repeat(c - qsl[:k], n)  # [total]
    input_ids = np.zeros(t_bucket, np.int32)
    positions = np.zeros(t_bucket, np.int32)
    slots = np.full(t_bucket, NULL_BLOCK * s, np.int32)
    input_ids[:total] = rows.token_ids[tok_row, pos]
    positions[:total] = pos
    slots[:total] = rows.block_table[tok_row, pos // s] * s + pos % s
    seq_lens = np.zeros(num_attention_rows, np.int32)
    seq_lens[:k] = end
    block_table = np.zeros((num_attention_rows, rows.max_blocks), np.int32)
    block_table[:k] = rows.block_table[r]
    logits_indices = np.zeros(num_attention_rows, np.int32)
    last = qsl[1:k + 1][plan.sample] - 1
    logits_indices[:len(last)] = last
    return BodyInputs(input_ids, positions, slots, block_table, seq_lens, qsl, logits_indices,
                      r[plan.sample])


def prepare_sampling(rows: RowState, sample_rows: np.ndarray, num_reqs_bucket: int,
                     prompt_mask, output_counts, max_num_logprobs: int) -> SamplingMetadata:
    """The sampler's metadata for the sampling rows, padded to R with the padding row.

    ``prompt_mask`` / ``output_counts`` ([R, V], device or host) are passed
    through; the worker gathers them only when a row has penalties.
    """
    idx = np.full(num_reqs_bucket, rows.max_num_seqs, np.int32)  # padding row M
    idx[:len(sample_rows)] = sample_rows
    p = rows.params
    fields = {f: p[f][idx] for f in PARAM_FIELDS}
    positions = np.zeros(num_reqs_bucket, np.int32)
    positions[:len(sample_rows)] = rows.num_tokens[sample_rows]
    num_output = rows.num_tokens[sample_rows] - rows.num_prompt_tokens[sample_rows]
    ban_active = np.zeros(num_reqs_bucket, bool)
    ban_active[:len(sample_rows)] = num_output < rows.min_tokens[sample_rows]
    return SamplingMetadata(positions=positions, ban_active=ban_active, prompt_mask=prompt_mask,
                            output_counts=output_counts, max_num_logprobs=max_num_logprobs,
                            **fields)
