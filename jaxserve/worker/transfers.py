"""A dispatched step's one upload and one download, and the ``PendingStep`` that reads it.

- ``upload(tree, placement)``: the explicit host → device copy of a step's
  inputs (the packed schedule, a new row, a bitmask).
- ``fetch(tree)``: the explicit device → host copy of a step's results.
  Tests replace both to count them: one of each per steady step.
- ``PendingStep``: what ``InProcessWorker.submit`` returns; ``result()``
  fetches the step's tokens once (with logprobs, the slots each row kept
  with draft tokens, a draft model's proposals, prompt logprobs) and times
  the step on the device (``DeviceClock``).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import numpy as np

from jaxserve.model import sharding
from jaxserve.step_plan import PromptLogprobs, StepResult
from jaxserve.worker.sampler import SamplerOutput


class DeviceClock:
    """When the latest step's results reached the host (``time.perf_counter``, seconds)."""

    def __init__(self) -> None:
        self.ready_at = 0.0


class PendingStep:
    """A dispatched step; ``result()`` waits for its tokens (once) and returns them.

    Attributes:
      step_id: the plan's step id.
    """

    def __init__(self, step_id: int, num_sampled: int, out: SamplerOutput | None,
                 logprobs: bool, done: jax.Array, dispatched: float, host_seconds: float,
                 clock: DeviceClock, on_done=None, prompt=None, drafts=None, proposals=None):
        self.step_id = step_id
        self._num_sampled, self._out, self._logprobs, self._done = num_sampled, out, logprobs, done
        self._dispatched, self._host_seconds, self._on_done = dispatched, host_seconds, on_done
        self._prompt = prompt  # (mr.PromptLogprobs on the device, token, index, position)
        # (kept bool[R] on the device, each sampling row's first slot i32[rows], the
        # callback taking its accepted drafts i32[rows]), or None without drafts
        self._drafts = drafts
        # (the draft model's proposals i32[R, k] on the device, each sampling row's
        # first slot i32[rows]), or None without a draft model
        self._proposals = proposals
        self._clock = clock
        self._lock = threading.Lock()
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        """The step's ``StepResult`` (blocks until the tokens are on the host)."""
        with self._lock:
            if self._result is None:
                self._result = self._fetch()
                if self._on_done is not None:
                    self._on_done(self._result)
            return self._result

    def _fetch(self) -> StepResult:
        s = self._num_sampled
        extra = {}
        if self._out is None:
            self._done.block_until_ready()
            result = StepResult(self.step_id, np.zeros(0, np.int32))
        else:
            tree = self._out if self._logprobs else self._out.token_ids
            if self._drafts is not None:
                extra["kept"] = self._drafts[0]
            if self._proposals is not None:
                extra["proposals"] = self._proposals[0]
            out, extra = fetch((tree, extra))  # the step's one download
            result = (StepResult(self.step_id, out[:s]) if not self._logprobs else StepResult(
                self.step_id, out.token_ids[:s], out.logprob[:s], out.rank[:s],
                out.top_token_ids[:s], out.top_logprobs[:s]))
        if "kept" in extra:
            _, starts, on_accepted = self._drafts
            accepted = (np.add.reduceat(extra["kept"][:s].astype(np.int32), starts) - 1
                        ).astype(np.int32)
            on_accepted(accepted)
            result = dataclasses.replace(result, num_accepted=accepted)
        if "proposals" in extra:  # each row's at its first slot
            result = dataclasses.replace(result,
                                         draft_token_ids=extra["proposals"][self._proposals[1]])
        if self._prompt is not None:
            device, token, index, position = self._prompt
            scored = fetch(device)
            result = dataclasses.replace(result, prompt_logprobs=PromptLogprobs(
                index, position, scored.logprob[token], scored.rank[token],
                scored.top_token_ids[token], scored.top_logprobs[token]))
        end = time.perf_counter()
        # The device runs steps in dispatch order: this one started no earlier
        # than its dispatch nor than the previous step's results (dispatch ahead).
        device_start = max(self._dispatched, self._clock.ready_at)
        self._clock.ready_at = end
        return dataclasses.replace(result, device_seconds=end - device_start,
                                   execute_seconds=self._host_seconds + end - device_start)


def upload(tree, placement=None):
    """An explicit host → device copy (tests count the calls: one per steady step).

    ``placement``: where the arrays go (the worker's replicated sharding on a
    mesh); None: the default device.
    """
    return sharding.place(tree, placement)


def fetch(tree):
    """The explicit device → host copy of a step's results (tests count the calls)."""
    return jax.device_get(tree)
