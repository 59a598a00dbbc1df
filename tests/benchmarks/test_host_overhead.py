"""Smoke test of ``benchmarks.host_overhead``: tiny runs against a real null-worker process,
the outputs read from a queue and over the engine's gRPC output stream."""

from __future__ import annotations

import json

from benchmarks import host_overhead

STEPS, WARMUP = 6, 4


def test_host_overhead_json(tmp_path):
    host_overhead.main(["--rows", "1,4", "--steps", str(STEPS), "--warmup", str(WARMUP),
                        "--results", str(tmp_path)])
    data = json.loads((tmp_path / "host_overhead.json").read_text())
    runs = data["runs"]
    assert [(r["outputs"], r["mode"], r["rows"]) for r in runs] == [
        (out, mode, rows) for out in ("queue", "stream") for mode in ("async", "sync")
        for rows in (1, 4)]
    for r in runs:
        assert r["steps"] >= STEPS  # a stream message may carry several steps
        # Every measured and warm-up step was applied by the engine and ran in the
        # worker process; async scheduling leaves at most one more plan in the worker.
        assert r["engine_steps"] >= STEPS + WARMUP
        extra = 1 if r["mode"] == "async" else 0
        assert r["engine_steps"] <= r["worker_steps"] <= r["engine_steps"] + extra
        assert r["steps_per_s"] > 0
        assert 0 < r["host_ms_p50"] <= r["host_ms_p99"]
        assert r["engine_cpu_ms"] > 0 and r["worker_cpu_ms"] >= 0
