"""Async scheduling (``EngineConfig.async_scheduling``) on the fake worker.

Oracles: ``expected_completion`` (the fake model run alone, no cache, no
engine) for every sequence's tokens and finish reason; the synchronous
engine for the step-for-step structure; wall-clock for the overlap itself.
The fake worker checks the step-plan contract on every plan (rows freed
before reuse, tokens and blocks present for every scheduled position, the
KV digest read through the block table), and the Hypothesis state machine of
``test_scheduler_state_machine`` runs again with async scheduling on.
"""

from __future__ import annotations

import functools
import random
import threading
import time

import pytest

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.core import PLACEHOLDER
from jaxserve.sampling_params import SamplingParams
from tests.engine import test_scheduler_state_machine as state_machine
from tests.engine.fake_worker import FakeWorker, expected_completion, reference_tokens

EOS = (0,)
MAX_LEN = 120


class RecordingWorker(FakeWorker):
    """A fake worker that records plans and can sleep per step (a slow device)."""

    def __init__(self, delay: float = 0.0, **kwargs):
        super().__init__(max_model_len=MAX_LEN, eos_token_ids=EOS, **kwargs)
        self.keep_plans = True
        self.delay = delay
        self.threads: set[str] = set()

    def execute(self, plan):
        self.threads.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        return super().execute(plan)


def _engine(async_scheduling=True, budget=32, num_blocks=300, max_num_seqs=8, caching=True,
            delay=0.0):
    config = EngineConfig(
        max_model_len=MAX_LEN, async_scheduling=async_scheduling,
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        cache=CacheConfig(block_size=4, num_kv_blocks=num_blocks, enable_prefix_caching=caching))
    worker = RecordingWorker(delay)
    return EngineCore(config, worker), worker


def _run(engine, requests, on_step=None):
    for rid, prompt, sp in requests:
        engine.add_request(EngineCoreRequest(rid, prompt, sp))
    tokens, finish, order = {}, {}, []
    while engine.has_unfinished_requests():
        outs = engine.step()
        for out in outs:
            key = (out.request_id, out.index)
            assert key not in finish, f"{key} emitted a token after it finished"
            tokens.setdefault(key, []).extend(out.new_token_ids)
            order.append(key)
            if out.finished:
                finish[key] = (out.finish_reason, out.stop_reason)
        if on_step is not None:
            on_step(engine, outs)
    return tokens, finish


def _random_requests(num, seed):
    rng = random.Random(seed)
    system = [rng.randrange(1, 64) for _ in range(12)]
    out = []
    for i in range(num):
        prompt = (system if i % 3 == 0 else []) + [rng.randrange(1, 64)
                                                   for _ in range(rng.randrange(1, 30))]
        ref = reference_tokens(prompt, 40)
        max_tokens = rng.randrange(1, 30)
        sp = SamplingParams(
            n=rng.choice([1, 1, 2]), max_tokens=max_tokens,
            ignore_eos=rng.random() < 0.5, min_tokens=min(max_tokens, rng.choice([0, 0, 3])),
            stop_token_ids=[ref[rng.randrange(40)]] if rng.random() < 0.5 else None)
        out.append((f"r{i}", prompt, sp))
    return out


def _check(requests, tokens, finish):
    for rid, prompt, sp in requests:
        for i in range(sp.n):
            want, reason, stop = expected_completion(prompt, sp, EOS, MAX_LEN)
            assert tokens[(rid, i)] == want, (rid, i)
            assert finish[(rid, i)] == (reason, stop), (rid, i)


@pytest.mark.parametrize("num_blocks,caching", [(300, True), (300, False), (40, True)])
def test_outputs_equal_the_reference_and_stops_emit_nothing_after(num_blocks, caching):
    requests = _random_requests(40, seed=num_blocks + caching)
    engine, worker = _engine(num_blocks=num_blocks, caching=caching)
    tokens, finish = _run(engine, requests)
    _check(requests, tokens, finish)
    if num_blocks == 40:
        assert engine.stats().num_preemptions > 0
    s = engine.stats()
    assert s.kv_blocks_used == 0 and sorted(engine.scheduler.free_rows) == list(range(8))
    assert worker.threads == {"engine-worker_0"}  # the worker ran on the helper thread


def test_steps_are_planned_while_the_previous_one_runs():
    """Plan N + 1 decodes the token sampled in step N before N's result is applied."""
    prompt = [3, 1, 4, 1, 5]
    engine, worker = _engine()
    _run(engine, [("a", prompt, SamplingParams(max_tokens=6, ignore_eos=True))])
    decodes = [p for p in worker.plans if not p.new_rows]
    # Step k (k >= 1) computes position len(prompt) + k - 1: the token sampled by step k - 1.
    assert [int(p.num_computed[0]) for p in decodes] == list(range(len(prompt), len(prompt) + 5))
    # The 6th token finishes the sequence by length, so no decode of it is planned.
    assert len(worker.plans) == 6


def test_sequence_stopping_at_step_n_drops_step_n_plus_1_and_frees_its_row_after_it():
    prompt = [5, 9, 13]
    ref = reference_tokens(prompt, 30)
    target = ref[3]
    stop_at = ref.index(target)
    engine, worker = _engine()
    sp = SamplingParams(max_tokens=30, stop_token_ids=[target], ignore_eos=True)
    tokens, finish = _run(engine, [("s", prompt, sp), ("long", [7, 7], SamplingParams(
        max_tokens=stop_at + 6, ignore_eos=True))])
    assert tokens[("s", 0)] == ref[:stop_at + 1] and finish[("s", 0)] == ("stop", target)
    row = worker.plans[0].new_rows[0].row
    runs = [i for i, p in enumerate(worker.plans) if row in p.rows.tolist()]
    freed = [i for i, p in enumerate(worker.plans) if row in p.freed_rows.tolist()]
    # It ran one step past its stop (planned before the stop was known)...
    assert len(runs) == stop_at + 2
    # ...and its row was freed in the plan right after that wasted step.
    assert freed == [runs[-1] + 1]


def test_preempted_while_in_flight_keeps_its_token():
    # 30 blocks for 6 sequences of 8 blocks each: the latest arrivals are
    # preempted while the step that sampled them is still in flight.
    requests = [(f"p{i}", [i + 1] * 7, SamplingParams(max_tokens=25, ignore_eos=True))
                for i in range(6)]
    engine, worker = _engine(num_blocks=31, max_num_seqs=6, budget=16)
    tokens, finish = _run(engine, requests)
    _check(requests, tokens, finish)
    assert engine.stats().num_preemptions > 0


def test_abort_between_steps_drops_the_token_in_flight():
    engine, worker = _engine()
    requests = [(f"a{i}", [i + 2] * 6, SamplingParams(max_tokens=40, ignore_eos=True))
                for i in range(3)]
    seen = {}

    def on_step(engine, outs):
        for out in outs:
            seen[out.request_id] = seen.get(out.request_id, 0) + 1
        if seen.get("a1") == 5:
            engine.abort_requests(["a1"])
            seen["a1"] = 99  # abort once

    tokens, finish = _run(engine, requests, on_step)
    assert len(tokens[("a1", 0)]) == 5 and ("a1", 0) not in finish
    for rid in ("a0", "a2"):
        assert tokens[(rid, 0)] == reference_tokens(requests[int(rid[1])][1], 40)
    assert engine.stats().kv_blocks_used == 0


def test_placeholders_never_leak_out_of_step():
    engine, _ = _engine()

    def on_step(engine, outs):
        for req in engine.scheduler.running + list(engine.scheduler.waiting):
            assert PLACEHOLDER not in req.token_ids

    _run(engine, _random_requests(12, seed=3), on_step)


def test_async_overlaps_the_callers_work_with_the_device():
    """A 30 ms device step and 30 ms of caller work per step: async hides the latter."""
    requests = [("x", [1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True))]
    elapsed = {}
    for mode in (False, True):
        engine, _ = _engine(async_scheduling=mode, delay=0.03)
        start = time.perf_counter()
        tokens, _ = _run(engine, requests, on_step=lambda e, o: time.sleep(0.03))
        elapsed[mode] = time.perf_counter() - start
        assert tokens[("x", 0)] == reference_tokens([1, 2, 3], 12)
        engine.shutdown()
    # Sync: 12 x (30 + 30) ms = 0.72 s; async: about 12 x 30 ms + one step.
    assert elapsed[True] < 0.75 * elapsed[False], elapsed


def test_state_machine_with_async_scheduling(monkeypatch):
    monkeypatch.setattr(state_machine, "EngineConfig",
                        functools.partial(EngineConfig, async_scheduling=True))
    state_machine.TestEngineStateMachine().runTest()
