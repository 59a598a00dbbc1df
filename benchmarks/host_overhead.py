"""The host's share of a step: the engine loop and the gRPC hop against a null worker.

    python -m benchmarks.host_overhead [--rows 1,64,256] [--steps 400] [--warmup 50]
        [--modes async,sync] [--results DIR]

A worker process with no model (``benchmarks.null_worker``: the real worker
server and protocol, each plan answered at once) stands in for the device,
so every millisecond of a step is the host's: the engine loop
(``EngineLoop``: scheduling, plan building, token processing, the outputs
published to a subscriber), the plan and result codecs and the gRPC round
trip, and the worker server's own handling. For each scheduling mode
(async, the default, and sync) and each R, R requests decode together in
steady state (``max_num_seqs`` 256, prompts of 32 tokens, ``max_tokens``
long enough that no sequence finishes; a block boundary crossed every 16
steps) and the benchmark reports per step:

- ``steps_per_s``: steps published per second of wall time;
- ``host_ms``: the interval between consecutive steps' outputs reaching the
  subscriber, mean / p50 / p99, milliseconds — the step time a device step
  of zero would get, so a device step longer than it never waits for the host;
- ``engine_cpu_ms`` / ``worker_cpu_ms``: CPU time per step of the engine
  process (this one: the loop, the gRPC client, the subscriber) and of the
  worker process, milliseconds;
- ``engine_steps`` / ``worker_steps``: steps the engine applied and plans the
  worker ran in the whole run (warm-up included; with async scheduling the
  worker may have run one more).

Prints a table and writes ``<results>/host_overhead.json``. On a shared CPU
the numbers move with the other load: run it a few times.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks import null_worker
from benchmarks.common import environment, percentiles, write_json
from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.grpc_worker import attach_worker_process
from jaxserve.engine.loop import EngineLoop
from jaxserve.sampling_params import SamplingParams

PROMPT_LEN = 32
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
BLOCK_SIZE = 16


def _process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(rows: int, async_scheduling: bool, steps: int, warmup: int) -> dict:
    """One run: ``rows`` sequences decoding for ``warmup`` + ``steps`` steps; see the module doc.

    Returns:
      a dict of the figures (see the module docstring) plus ``rows``, ``mode``, ``steps``.

    Raises:
      RuntimeError: the engine failed, or a step's outputs did not cover every row.
    """
    max_model_len = PROMPT_LEN + warmup + steps + 64
    blocks_per_seq = -(-max_model_len // BLOCK_SIZE)
    config = EngineConfig(
        max_model_len=max_model_len, async_scheduling=async_scheduling,
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS,
                                  max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS),
        cache=CacheConfig(block_size=BLOCK_SIZE,
                          num_kv_blocks=MAX_NUM_SEQS * blocks_per_seq + 1))
    worker = attach_worker_process(null_worker.spawn(), start_timeout=60.0)
    core = EngineCore(config, worker)
    loop = EngineLoop(core)
    outputs = loop.subscribe()
    rng = np.random.default_rng(rows)
    params = SamplingParams(max_tokens=max_model_len - PROMPT_LEN, ignore_eos=True)
    for i, prompt in enumerate(rng.integers(1, null_worker.VOCAB_SIZE, (rows, PROMPT_LEN))):
        core.add_request(EngineCoreRequest(f"r{i}", prompt.tolist(), params))  # before the loop runs
    loop.start()
    try:
        stamps: list[float] = []
        cpu = {}
        seen = 0
        while len(stamps) < steps + 1:
            batch = outputs.get(timeout=60.0)
            if batch.error:
                raise RuntimeError(f"the engine failed: {batch.error}")
            seen += 1
            if seen <= warmup:
                continue
            if len(batch.outputs) != rows:
                raise RuntimeError(f"a decode step returned {len(batch.outputs)} outputs for "
                                   f"{rows} rows (a row not decoding?)")
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                cpu = {"engine": time.process_time(),
                       "worker": _process_cpu_seconds(worker.pid)}
        engine_cpu = time.process_time() - cpu["engine"]
        worker_cpu = _process_cpu_seconds(worker.pid) - cpu["worker"]
        loop.stop()
        engine_steps, worker_steps = core.num_steps, worker.status().num_steps
    finally:
        loop.stop()
        core.shutdown()
    host_ms = percentiles(np.diff(np.array(stamps)) * 1e3, (50, 99))
    return {
        "rows": rows, "mode": "async" if async_scheduling else "sync", "steps": steps,
        "steps_per_s": steps / (stamps[-1] - stamps[0]),
        **{f"host_ms_{k}": v for k, v in host_ms.items()},
        "engine_cpu_ms": engine_cpu / steps * 1e3,
        "worker_cpu_ms": worker_cpu / steps * 1e3,
        "engine_steps": engine_steps, "worker_steps": worker_steps,
    }


def table(runs: list[dict]) -> str:
    lines = [f"{'mode':6s} {'R':>4s} {'steps/s':>8s} {'host ms mean':>12s} {'p50':>6s} "
             f"{'p99':>6s} {'engine cpu ms':>13s} {'worker cpu ms':>13s}"]
    for r in runs:
        lines.append(f"{r['mode']:6s} {r['rows']:4d} {r['steps_per_s']:8.0f} "
                     f"{r['host_ms_mean']:12.2f} {r['host_ms_p50']:6.2f} {r['host_ms_p99']:6.2f} "
                     f"{r['engine_cpu_ms']:13.2f} {r['worker_cpu_ms']:13.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,64,256",
                        help=f"comma-separated R values, each <= {MAX_NUM_SEQS} (default 1,64,256)")
    parser.add_argument("--steps", type=int, default=400, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=50,
                        help="steps before the measurement (the prefills among them)")
    parser.add_argument("--modes", default="async,sync", help="async, sync or both")
    parser.add_argument("--results", default="results", help="folder for host_overhead.json")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    if not all(1 <= r <= MAX_NUM_SEQS for r in rows):
        parser.error(f"--rows must be in [1, {MAX_NUM_SEQS}]")
    if not set(modes) <= {"async", "sync"}:
        parser.error("--modes takes async and/or sync")
    if args.steps < 2 or args.warmup < 2:
        parser.error("--steps and --warmup must be >= 2")
    runs = [measure(r, mode == "async", args.steps, args.warmup) for mode in modes for r in rows]
    print(table(runs))
    results = {"benchmark": "host_overhead", "args": vars(args), "environment": environment(),
               "max_num_seqs": MAX_NUM_SEQS, "prompt_len": PROMPT_LEN, "runs": runs}
    write_json(args.results, "host_overhead", results)
    return results


if __name__ == "__main__":
    main()
