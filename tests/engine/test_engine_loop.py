"""``EngineLoop`` bookkeeping: which requests are unfinished, on the fake worker.

The loop keeps, per request, the indices of its unfinished completions, so
that ``abort_all`` (the api's output stream closed) and the failure path
reach every running completion. Aborting a completion that is already
finished or aborted must not count it twice: with ``n`` > 1 that used to
drop the request from the loop's books while a sibling still ran, and
``abort_all`` then left it running with its blocks. (The second test also
found the scheduler ending a sequence named twice in one abort twice.)

Recovery: when a step raises, the loop fails the unfinished requests, then
replaces the core through ``restart`` and serves again; restart attempts
are bounded over the loop's life, and when none is left (or none works) the
loop gives up and stays failed.
"""

from __future__ import annotations

import threading
import time

import pytest

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.loop import EngineDeadError, EngineLoop
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import WorkerDiedError
from tests.engine.fake_worker import FakeWorker, reference_tokens

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


class _SlowWorker(FakeWorker):
    """A ``FakeWorker`` whose steps take ``step_s`` seconds (so a request outlives a few commands)."""

    def __init__(self, step_s: float, **kwargs):
        super().__init__(**kwargs)
        self.step_s = step_s

    def execute(self, plan):
        time.sleep(self.step_s)
        return super().execute(plan)


class _DyingWorker(_SlowWorker):
    """Raises ``WorkerDiedError`` (as ``GrpcWorker`` does) from its ``die_at``-th step on.

    Only steps taken once ``armed`` is set count, so a test can queue all its
    requests before the worker dies (steps run ahead of the test's thread).
    """

    def __init__(self, die_at: int, step_s: float = 0.0, armed: threading.Event | None = None,
                 **kwargs):
        super().__init__(step_s, **kwargs)
        self.die_at = die_at
        self.armed = armed
        self.steps = 0

    def execute(self, plan):
        if self.armed is None or self.armed.is_set():
            self.steps += 1
        if self.steps >= self.die_at:
            raise WorkerDiedError("the worker at 127.0.0.1:1 died: Execute failed: UNAVAILABLE")
        return super().execute(plan)


CONFIG = EngineConfig(max_model_len=256,
                      scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
                      cache=CacheConfig(block_size=4, num_kv_blocks=256))


def _loop(step_s: float = 0.02) -> EngineLoop:
    loop = EngineLoop(EngineCore(CONFIG, _SlowWorker(step_s, max_model_len=256)))
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


class _Events:
    """What the loop's callbacks reported."""

    def __init__(self):
        self.failures: list[str] = []
        self.recovered = threading.Event()
        self.gave_up = threading.Event()

    def kwargs(self) -> dict:
        return dict(on_failure=self.failures.append, on_recovery=self.recovered.set,
                    on_give_up=self.gave_up.set)


def _wait_error(outputs) -> tuple:
    while True:
        batch = outputs.get(timeout=30)
        if batch.error:
            return batch.failed_request_ids


def test_a_failed_step_fails_its_requests_then_a_new_core_serves():
    events = _Events()
    old_cores = []

    def restart(old):
        old_cores.append(old)
        return EngineCore(CONFIG, FakeWorker(max_model_len=256))

    armed = threading.Event()
    worker = _DyingWorker(1, step_s=0.01, armed=armed, max_model_len=256)
    loop = EngineLoop(EngineCore(CONFIG, worker), restart=restart, max_restarts=3,
                      **events.kwargs())
    outputs = loop.subscribe()
    loop.start()
    try:
        for i in range(3):  # 200 tokens each: still running when the worker dies
            loop.add_request(EngineCoreRequest(f"q{i}", [i + 1] * 5, LONG))
        armed.set()
        assert set(_wait_error(outputs)) == {"q0", "q1", "q2"}
        assert events.recovered.wait(30) and loop.serving and not loop.error
        assert len(events.failures) == 1 and "WorkerDiedError" in events.failures[0]
        assert len(old_cores) == 1 and not old_cores[0].serving
        _assert_empty(loop)
        loop.add_request(EngineCoreRequest("after", [3, 1, 4], SamplingParams(
            max_tokens=6, ignore_eos=True)))
        tokens = []
        while len(tokens) < 6:
            batch = outputs.get(timeout=30)
            assert not batch.error
            tokens += [t for o in batch.outputs for t in o.new_token_ids]
        assert tokens == reference_tokens([3, 1, 4], 6)
        assert loop.stats().num_worker_restarts == 1
        _assert_empty(loop)
        assert not events.gave_up.is_set()
    finally:
        loop.stop()


def test_restarts_are_bounded_over_the_loops_life():
    events = _Events()
    loop = EngineLoop(EngineCore(CONFIG, _DyingWorker(1, max_model_len=256)),
                      restart=lambda old: EngineCore(CONFIG, _DyingWorker(2, max_model_len=256)),
                      max_restarts=2, **events.kwargs())
    outputs = loop.subscribe()
    loop.start()
    try:
        for attempt in range(3):  # the first worker and two replacements each die
            assert events.recovered.wait(30) if attempt else True
            events.recovered.clear()
            loop.add_request(EngineCoreRequest(f"r{attempt}", [1, 2, 3], LONG))
            assert _wait_error(outputs) == (f"r{attempt}",)
        assert events.gave_up.wait(30)
        assert not loop.serving and len(events.failures) == 3
        assert loop.stats().num_worker_restarts == 2
        with pytest.raises(EngineDeadError):
            loop.add_request(EngineCoreRequest("late", [1], LONG))
    finally:
        loop.stop()


def test_a_restart_that_keeps_failing_gives_up_after_max_attempts():
    events = _Events()
    attempts = []

    def restart(old):
        attempts.append(old)
        raise WorkerDiedError("the worker process did not start (status 1, stdout '')")

    loop = EngineLoop(EngineCore(CONFIG, _DyingWorker(1, max_model_len=256)), restart=restart,
                      max_restarts=3, **events.kwargs())
    outputs = loop.subscribe()
    loop.start()
    try:
        loop.add_request(EngineCoreRequest("r", [1, 2, 3], LONG))
        assert _wait_error(outputs) == ("r",)
        assert events.gave_up.wait(30)
        assert len(attempts) == 3 and loop.stats().num_worker_restarts == 3
        assert not loop.serving and not events.recovered.is_set()
    finally:
        loop.stop()
