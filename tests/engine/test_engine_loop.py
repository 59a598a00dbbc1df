"""``EngineLoop`` bookkeeping: which requests are unfinished, on the fake worker.

The loop keeps, per request, the indices of its unfinished completions, so
that ``abort_all`` (the api's output stream closed) and the failure path
reach every running completion. Aborting a completion that is already
finished or aborted must not count it twice: with ``n`` > 1 that used to
drop the request from the loop's books while a sibling still ran, and
``abort_all`` then left it running with its blocks. (The second test also
found the scheduler ending a sequence named twice in one abort twice.)
"""

from __future__ import annotations

import time

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.loop import EngineLoop
from jaxserve.sampling_params import SamplingParams
from tests.engine.fake_worker import FakeWorker

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


class _SlowWorker(FakeWorker):
    """A ``FakeWorker`` whose steps take ``step_s`` seconds (so a request outlives a few commands)."""

    def __init__(self, step_s: float, **kwargs):
        super().__init__(**kwargs)
        self.step_s = step_s

    def execute(self, plan):
        time.sleep(self.step_s)
        return super().execute(plan)


def _loop(step_s: float = 0.02) -> EngineLoop:
    config = EngineConfig(max_model_len=256,
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
                          cache=CacheConfig(block_size=4, num_kv_blocks=256))
    loop = EngineLoop(EngineCore(config, _SlowWorker(step_s, max_model_len=256)))
    loop.start()
    return loop


def _assert_empty(loop: EngineLoop) -> None:
    stats = loop.stats()
    assert not loop.call(loop.core.has_unfinished_requests)
    assert stats.kv_blocks_used == 0
    assert stats.kv_blocks_free + stats.kv_blocks_cached == stats.kv_blocks_total


def test_aborting_a_completion_twice_keeps_its_sibling_for_abort_all():
    loop = _loop()
    try:
        loop.add_request(EngineCoreRequest("r", [1, 2, 3, 4, 5], SamplingParams(
            n=2, max_tokens=200, ignore_eos=True)))
        loop.abort([("r", 0)])
        loop.abort([("r", 0)])  # already aborted: completion 1 still runs
        assert loop.call(loop.core.has_unfinished_requests)
        loop.abort_all()
        _assert_empty(loop)
    finally:
        loop.stop()


def test_abort_all_reaches_every_unfinished_request():
    loop = _loop()
    try:
        for i in range(3):
            loop.add_request(EngineCoreRequest(f"q{i}", [i + 1] * 6, LONG))
        loop.add_request(EngineCoreRequest("pair", [7, 7], SamplingParams(
            n=2, max_tokens=200, ignore_eos=True)))
        loop.abort(["q1", ("pair", 1), ("pair", 1), "q1", "unknown", ("unknown", 3)])
        loop.abort_all()
        _assert_empty(loop)
    finally:
        loop.stop()
