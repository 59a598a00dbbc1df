"""Turns a ``ScheduledStep`` into a ``StepPlan``: row diffs, schedule, bucket (jax-free).

The bucket is the smallest ``(T, R)`` on the ladders that holds the step's
tokens (drafts included) and sampling slots (one per sampling row and one per
draft; R = 0 when no row samples). Blocks appended to a
row since the worker last heard of it travel as ``append_rows`` /
``append_block_ids``; a sequence new on its row sends all its known tokens
and blocks in a ``NewRow``.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from jaxserve.engine.scheduler import ScheduledStep
from jaxserve.step_plan import NewRow, StepPlan

_I32 = np.int32


def pick_bucket(ladder: tuple[int, ...], n: int) -> int:
    """The smallest ladder entry >= n.

    Raises:
      ValueError: n exceeds the ladder's top.
    """
    i = bisect.bisect_left(ladder, n)
    if i == len(ladder):
        raise ValueError(f"{n} exceeds the bucket ladder {ladder}")
    return ladder[i]


def build_plan(step: ScheduledStep, step_id: int, token_buckets: tuple[int, ...],
               request_buckets: tuple[int, ...]) -> StepPlan:
    """The step plan of ``step``; marks the blocks it sends as known to the worker.

    Its ``token_bitmask`` is None: the engine adds the structured-output masks from
    the matchers' state when it submits the plan (``EngineCore._with_masks``).
    """
    new_rows = []
    for req in step.new_reqs:
        params = req.sampling_params
        if params.prompt_logprobs is not None and req.prompt_logprobs is None:
            # sample > 0, or emitted before a preemption: the worker scores nothing
            params = dataclasses.replace(params, prompt_logprobs=None)
        new_rows.append(NewRow(
            row=req.row, token_ids=np.array(req.token_ids, _I32),
            num_prompt_tokens=req.num_prompt_tokens, sampling_params=params,
            seed=req.seed, block_ids=np.array(req.block_ids, _I32)))
        req.num_blocks_sent = len(req.block_ids)
    append_rows: list[int] = []
    append_ids: list[int] = []
    for req in step.reqs:
        sent = req.num_blocks_sent
        if sent < len(req.block_ids):
            added = req.block_ids[sent:]
            append_rows.extend([req.row] * len(added))
            append_ids.extend(added)
            req.num_blocks_sent = len(req.block_ids)
    n = len(step.reqs)
    num_slots = sum(step.num_slots(i) for i in range(n))
    drafts = None if step.drafts is None else dict(
        num_draft=np.fromiter(map(len, step.drafts), _I32, n),
        draft_token_ids=np.array([t for d in step.drafts for t in d], _I32))
    return StepPlan(
        step_id=step_id,
        freed_rows=np.array(step.freed_rows, _I32),
        new_rows=tuple(new_rows),
        append_rows=np.array(append_rows, _I32),
        append_block_ids=np.array(append_ids, _I32),
        rows=np.fromiter((r.row for r in step.reqs), _I32, n),
        num_computed=np.array(step.num_computed, _I32),
        num_tokens=np.array(step.num_tokens, _I32),
        sample=np.array(step.sample, np.bool_),
        num_tokens_bucket=pick_bucket(token_buckets, step.total_tokens),
        num_reqs_bucket=pick_bucket(request_buckets, num_slots) if num_slots else 0,
        **(drafts or {}))
