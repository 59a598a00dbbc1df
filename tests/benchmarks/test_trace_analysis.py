"""The step breakdown's arithmetic against hand-computed timelines and a brute-force oracle."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.trace_analysis import OpEvent, StepMark, breakdown, executions, split_time

CATS = {"dot.1": "matmul", "while.1": "attention", "fusion.2": "attention",
        "scatter.1": "kv_write", "fusion.9": "other", "sort.1": "sampler"}


def categorizer(module, ops, num_tokens=None):
    assert ops <= CATS.keys()
    return CATS.__getitem__, ((num_tokens or 8) if module == "jit_run_body" else None)


def ev(thread, start, end, op, module="jit_run_body", run=1):
    return OpEvent(thread, start, end, module, op, run)


def test_nested_ops_own_their_time_and_threads_share():
    # thread 0: while [0, 100) holding fusion.2 [10, 40); thread 1: dot [20, 60)
    # [0,10) attention (while); [10,20) attention (fusion); [20,40) fusion+dot shared 1/2
    # [40,60) while + dot shared; [60,100) while alone.
    ops = [ev(0, 0, 100, "while.1"), ev(0, 10, 40, "fusion.2"), ev(1, 20, 60, "dot.1")]
    (x,) = executions(ops, categorizer)
    assert x.span == 100 and x.num_tokens == 8
    assert x.busy["attention"] == pytest.approx(10 + 10 + 10 + 10 + 40)
    assert x.busy["matmul"] == pytest.approx(10 + 10)
    assert x.busy["exec_idle"] == pytest.approx(0)


def test_steps_gaps_and_totals_add_up_to_the_window():
    us = 1000  # ns per µs: the breakdown reports ms rounded to 4 decimals
    ops = [ev(0, 100 * us, 150 * us, "dot.1", run=1),
           ev(0, 160 * us, 170 * us, "scatter.1", run=1),  # idle 150-160 inside the execution
           ev(0, 180 * us, 200 * us, "sort.1", "jit_run_sampler", run=2),
           ev(0, 260 * us, 300 * us, "fusion.9", run=3)]
    result = breakdown(executions(ops, categorizer), (0, 400 * us))
    assert result["num_steps"] == 2
    first, second = result["steps"]
    assert first["duration_ms"] == pytest.approx(0.160)  # 100 -> 260 µs
    assert first["host_gap"] == pytest.approx(0.070)  # 170-180 and 200-260
    assert first["exec_idle"] == pytest.approx(0.010)
    assert first["matmul"] == pytest.approx(0.050) and first["kv_write"] == pytest.approx(0.010)
    assert first["sampler"] == pytest.approx(0.020)
    assert first["executions"] == ["jit_run_body", "jit_run_sampler"]
    assert second["host_gap"] == pytest.approx(0) and second["other"] == pytest.approx(0.040)
    totals = result["totals_ms"]
    assert totals["host_gap"] == pytest.approx(0.100 + 0.010 + 0.060 + 0.100)
    assert sum(totals.values()) == pytest.approx(0.400)
    assert sum(result["percent_of_wall"].values()) == pytest.approx(100, abs=0.05)
    assert [b["num_tokens"] for b in result["by_bucket"]] == [8]


def test_step_marks_give_each_execution_its_bucket():
    ops = [ev(0, 10, 20, "dot.1", run=1), ev(0, 30, 40, "dot.1", run=2),
           ev(0, 50, 60, "dot.1", run=3)]
    marks = [StepMark(5, 25, 16, 2), StepMark(28, 45, 1, 1)]  # the third runs outside any mark
    got = [x.num_tokens for x in executions(ops, categorizer, marks)]
    assert got == [16, 1, 8]


def test_split_time_matches_a_per_tick_oracle():
    rng = np.random.default_rng(0)
    labels = ["a", "b", "c"]
    segments = []
    for _ in range(40):
        a = int(rng.integers(0, 500))
        segments.append((a, a + int(rng.integers(1, 80)), labels[int(rng.integers(3))]))
    got = split_time(segments)
    want = dict.fromkeys(labels, 0.0)
    for tick in range(600):  # each unit interval [tick, tick + 1) split among active segments
        active = [s for s in segments if s[0] <= tick < s[1]]
        for _, _, label in active:
            want[label] += 1 / len(active)
    for label in labels:
        assert got.get(label, 0.0) == pytest.approx(want[label], abs=1e-9)


def test_empty_window_is_an_error():
    with pytest.raises(ValueError):
        breakdown([], (5, 5))
