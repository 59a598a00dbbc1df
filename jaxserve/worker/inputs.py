"""The host half of a step: one packed i32 buffer, the step's only upload.

A step's executables build every fixed-shape input on the device
(``device_inputs.py``) from the persistent device rows and this buffer,
whose layout is fixed by the token bucket T (``StepLayout``):

====================  ======  =================================================
segment               length  content (padding)
====================  ======  =================================================
header                2       server seed (low 32 bits), step id
``input_ids``         T       query tokens the host knows (prompt tokens, and
                              a resumed sequence's earlier output); -1 = the
                              row's last sampled token, read on the device (0)
``rows``              RA      persistent row of each scheduled row (M)
``num_computed``      RA      tokens of the row already in the KV cache (0)
``num_tokens``        RA      query tokens of the row (0)
``sample``            RA      the row's sampling slots: 0, or 1 + its draft
                              tokens (it samples after each of its last
                              ``sample`` query tokens) (0)
``append_rows``       A       row of each block appended this step (M + 1:
                              dropped by the device scatter)
``append_index``      A       its index in the row's block table (0)
``append_blocks``     A       the block id (0)
====================  ======  =================================================

RA = min(T, M) attention rows (every scheduled row runs at least one token,
so a step of T tokens has at most T rows; a batch-1 decode in the T = 1
bucket carries one row of metadata, not M), and A = 2 RA + ceil(T / S)
appended blocks (a row running n tokens needs at most ceil(n / S) + 1 new
blocks). A step whose appends do not fit resynchronises those rows' whole
block-table rows instead (``InProcessWorker``). So the buffer is O(T), never
O(rows × blocks) nor O(M), and independent of the context length.

Shape legend: T token bucket, RA attention rows, A appended-block slots,
M = max_num_seqs, S block size, n scheduled rows, s sampling rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.step_plan import StepPlan
from jaxserve.worker.rows import RowState

HEADER = 2  # seed, step id
SEGMENTS = ("input_ids", "rows", "num_computed", "num_tokens", "sample", "append_rows",
            "append_index", "append_blocks")


@dataclasses.dataclass(frozen=True, slots=True)
class StepLayout:
    """Where each segment of the packed step buffer lies (static: it keys executables).

    Attributes:
      num_tokens: T.
      num_rows: RA = min(T, M).
      num_appends: A.
      max_num_seqs: M (the padding row's index).
    """

    num_tokens: int
    num_rows: int
    num_appends: int
    max_num_seqs: int

    @classmethod
    def for_bucket(cls, num_tokens: int, max_num_seqs: int, block_size: int) -> StepLayout:
        """The layout of token bucket T = ``num_tokens``."""
        ra = min(num_tokens, max_num_seqs)
        return cls(num_tokens, ra, 2 * ra - (-num_tokens // block_size), max_num_seqs)

    def length(self, segment: str) -> int:
        t, ra, a = self.num_tokens, self.num_rows, self.num_appends
        return {"input_ids": t, "append_rows": a, "append_index": a,
                "append_blocks": a}.get(segment, ra)

    def segment(self, name: str) -> slice:
        """The buffer slice of segment ``name``."""
        start = HEADER
        for seg in SEGMENTS:
            if seg == name:
                return slice(start, start + self.length(seg))
            start += self.length(seg)
        raise KeyError(name)

    @property
    def size(self) -> int:
        """Length of the buffer, i32 elements."""
        return HEADER + sum(self.length(s) for s in SEGMENTS)


def pack(layout: StepLayout, *, seed: int, step_id: int, input_ids: np.ndarray,
         rows: np.ndarray, num_computed: np.ndarray, num_tokens: np.ndarray, sample: np.ndarray,
         append_rows: np.ndarray, append_index: np.ndarray,
         append_blocks: np.ndarray) -> np.ndarray:
    """The buffer i32[layout.size]: each segment's values, then its padding.

    Raises:
      ValueError: a segment longer than the layout allows.
    """
    buffer = np.zeros(layout.size, np.int32)
    buffer[:HEADER] = np.array([seed & 0xFFFFFFFF, step_id & 0xFFFFFFFF], np.uint32).view(np.int32)
    values = dict(input_ids=input_ids, rows=rows, num_computed=num_computed,
                  num_tokens=num_tokens, sample=sample, append_rows=append_rows,
                  append_index=append_index, append_blocks=append_blocks)
    padding = dict(rows=layout.max_num_seqs, append_rows=layout.max_num_seqs + 1)
    for name in SEGMENTS:
        part, where = np.asarray(values[name]), layout.segment(name)
        if len(part) > layout.length(name):
            raise ValueError(f"{name}: {len(part)} entries exceed the bucket's "
                             f"{layout.length(name)} (T={layout.num_tokens})")
        buffer[where][:len(part)] = part
        buffer[where][len(part):] = padding.get(name, 0)
    return buffer


def query_input_ids(rows: RowState, plan: StepPlan) -> np.ndarray:
    """Validates the plan's schedule against the rows; returns its input ids i32[total].

    A query token the host knows (``RowState.num_known``) is its id; the one
    token it may not know — a decode row's last token, sampled by an earlier
    step, possibly still in flight — is -1 (read on the device). A row's
    draft tokens (``StepPlan.num_draft``) end its query and are the plan's.

    Raises:
      ValueError: a scheduled row is not in use or appears twice, lacks the
        tokens or blocks its query needs, samples before computing all its
        tokens, or needs a token that is neither known nor its last.
    """
    r, c, n = plan.rows, plan.num_computed, plan.num_tokens
    drafts = np.zeros_like(n) if plan.num_draft is None else plan.num_draft  # [n]
    end = c + n - drafts  # [n] after the row's tokens, before its drafts
    if len(r) and (not rows.in_use[r].all() or (end > rows.num_tokens[r]).any()
                   or (end + drafts > rows.num_blocks[r] * rows.block_size).any()
                   or (end + drafts > rows.max_model_len).any() or (n < 1).any()
                   or len(np.unique(r)) != len(r)):
        raise ValueError(f"step {plan.step_id}: rows {r.tolist()} lack tokens or blocks for "
                         f"num_computed {c.tolist()} + num_tokens {n.tolist()}")
    if (plan.sample & (end != rows.num_tokens[r])).any():
        raise ValueError(f"step {plan.step_id}: a row samples before computing all its tokens")
    start = np.cumsum(n) - n  # [n] first query token of each row
    tok_row = np.repeat(r, n)  # [total]
    pos = np.arange(int(n.sum()), dtype=np.int32) + np.repeat(c - start, n)  # [total]
    draft = pos >= np.repeat(end, n)  # [total]
    known = pos < rows.num_known[tok_row]
    if (~known & ~draft & (pos != rows.num_tokens[tok_row] - 1)).any():
        raise ValueError(f"step {plan.step_id}: a query token is neither known to the worker "
                         f"nor its row's last sampled token")
    ids = np.where(known, rows.token_ids[tok_row, np.minimum(pos, rows.max_model_len - 1)], -1)
    if plan.num_draft is not None:
        d = plan.draft_token_ids
        if ((d < 0) | (d >= rows.vocab_size)).any():
            raise ValueError(f"step {plan.step_id}: draft token ids outside the vocabulary "
                             f"[0, {rows.vocab_size}): {d[(d < 0) | (d >= rows.vocab_size)]}")
        ids[draft] = d
    return ids.astype(np.int32)


def prompt_logprob_targets(rows: RowState, plan: StepPlan, num_tokens: int
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """What ``run_prompt_logprobs`` scores in this step, or None when nothing.

    A row with prompt logprobs (``RowState.prompt_logprobs`` >= 0) scores, for
    each query token at position p with p + 1 < its prompt length, the prompt
    token at p + 1 (``step_plan.PromptLogprobs``).

    Args:
      num_tokens: T, the step's token bucket.

    Returns:
      (targets i32[2, T]: the next prompt token and N per token of the step,
      N = -1 where not scored; token i32[p]: the scored tokens' indices in
      the step; index i32[p]: their rows' indices in ``plan.rows``;
      position i32[p]: the positions of the tokens scored), or None.
    """
    r, c, n = plan.rows, plan.num_computed, plan.num_tokens
    want = rows.prompt_logprobs[r] >= 0  # [n]
    if not want.any():
        return None
    start = np.cumsum(n) - n  # [n]
    tok_index = np.repeat(np.arange(len(r), dtype=np.int32), n)  # [total]
    pos = np.arange(int(n.sum()), dtype=np.int32) + np.repeat(c - start, n)  # [total]
    tok_row = r[tok_index]
    token = np.flatnonzero(want[tok_index] & (pos + 1 < rows.num_prompt_tokens[tok_row]))
    if not token.size:
        return None
    targets = np.zeros((2, num_tokens), np.int32)
    targets[1] = -1
    scored = pos[token] + 1
    targets[0, token] = rows.token_ids[tok_row[token], scored]
    targets[1, token] = rows.prompt_logprobs[tok_row[token]]
    return targets, token.astype(np.int32), tok_index[token], scored.astype(np.int32)
