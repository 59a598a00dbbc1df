"""Benchmark (not a test): the engine's CPU time per decode step at 256 running sequences.

Run: ``python -m tests.engine.scheduler_benchmark [--running 256] [--steps 300]``

A worker that answers instantly (``benchmarks.null_worker.NullWorker``, no checks)
isolates the engine's own work per step: ``schedule()`` + ``build_plan()``
+ ``update()``. Reported per phase (median and p90 over the steps, in
milliseconds; ``time.perf_counter``) once every sequence is decoding, with
prefix caching on and a block boundary crossed every 16 steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.null_worker import NullWorker
from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.plan_builder import build_plan
from jaxserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    n = args.running
    config = EngineConfig(
        max_model_len=2048, async_scheduling=False,  # it calls schedule() / update() itself
        scheduler=SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=2048),
        cache=CacheConfig(block_size=16, num_kv_blocks=n * 40 + 1))
    engine = EngineCore(config, NullWorker())
    rng = np.random.default_rng(1)
    for i in range(n):
        prompt = rng.integers(1, 32000, 100).tolist()
        engine.add_request(EngineCoreRequest(f"r{i}", prompt,
                                             SamplingParams(max_tokens=1500, ignore_eos=True)))
    running = engine.scheduler.running
    while len(running) < n or any(r.num_output_tokens == 0 for r in running):  # prefills
        engine.step()
    s, sched = engine.scheduler, config.scheduler
    times = {"schedule": [], "build_plan": [], "update": [], "total": []}
    for step_id in range(args.steps):
        t0 = time.perf_counter()
        step = s.schedule()
        t1 = time.perf_counter()
        plan = build_plan(step, step_id, sched.token_buckets, sched.request_buckets)
        t2 = time.perf_counter()
        result = engine.worker.execute(plan)
        t3 = time.perf_counter()
        s.update(step, result)
        t4 = time.perf_counter()
        assert len(step.reqs) == n and step.total_tokens == n
        for name, dt in (("schedule", t1 - t0), ("build_plan", t2 - t1), ("update", t4 - t3),
                         ("total", (t2 - t0) + (t4 - t3))):
            times[name].append(dt * 1e3)
    print(f"engine CPU time per decode step, {n} running sequences, {args.steps} steps (ms):")
    for name, xs in times.items():
        xs = sorted(xs)
        print(f"  {name:10s} median {statistics.median(xs):.3f}  p90 {xs[int(0.9 * len(xs))]:.3f}")


if __name__ == "__main__":
    main()
