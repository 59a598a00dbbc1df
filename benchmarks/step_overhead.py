"""Per-step overhead of the engine <-> worker loop, with and without async scheduling.

    python -m benchmarks.step_overhead [--rows 1,16,64] [--steps 24]
        [--transports in_process,grpc] [--plan-bytes] [--start-times]
        [--model DIR] [--dtype float32] [--attention-backend NAME]

For each transport (the worker in process, or a worker process over gRPC)
and each R (sequences decoding together), the model (default: the demo
model) decodes R
sequences in steady state (prefill done, no sequence finishing) and the
benchmark reports, per step:

- wall: the interval between consecutive ``EngineCore.step()`` returns;
- device: the worker's time from dispatching the step's executables to its
  results being on the host (``StepResult.device_seconds``);
- overhead = wall - device: scheduling, plan building, the RPC hop, the
  worker's row updates and input building, the output handling — what
  async scheduling is meant to hide behind the device;
- worker host: the worker's own time outside the device
  (``execute_seconds - device_seconds``).

``--plan-bytes`` prints the serialized size of a decode step's plan at
R = 1, 8, 64, 256 (``jaxserve.plan_codec``) and the bytes the worker
uploads for it (the packed step buffer, ``jaxserve.worker.inputs``); ``--start-times`` starts a
worker process twice on a fresh persistent-cache directory with the demo
model and reports both times to ready. Numbers on a shared 2-core CPU are
noisy: compare the columns side by side, within one run.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import numpy as np

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.config import CompileConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import StepPlan, WorkerInit

PROMPT_LEN = 32
T_LADDER, R_LADDER = (1, 16, 64, 512), (1, 16, 64)


def _config(async_scheduling: bool, model: str | None, dtype: str,
            backend: str | None = None) -> EngineConfig:
    return EngineConfig(
        model=model, dtype=dtype, max_model_len=1024, async_scheduling=async_scheduling,
        attention_backend=backend,
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                  token_buckets=T_LADDER, request_buckets=R_LADDER),
        cache=CacheConfig(block_size=16, num_kv_blocks=64 * 8 + 1),
        compile=CompileConfig(strict_recompile=True))


def measure(worker, rows: int, async_scheduling: bool, steps: int, model: str | None = None,
            dtype: str = "float32", backend: str | None = None) -> dict[str, float]:
    """Median per-step wall / device / worker-host seconds over ``steps`` decode steps."""
    engine = EngineCore(_config(async_scheduling, model, dtype, backend), worker)
    rng = np.random.default_rng(rows)
    for i in range(rows):
        prompt = rng.integers(100, 40000, PROMPT_LEN).tolist()
        engine.add_request(EngineCoreRequest(f"r{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=steps + 16, ignore_eos=True)))
    while engine.stats().num_waiting or engine.num_steps < 4:  # prefill, then settle
        engine.step()
    walls, devices, hosts = [], [], []
    last = time.perf_counter()
    for _ in range(steps):
        device, worker_s = engine.device_seconds, engine.worker_seconds
        outputs = engine.step()
        now = time.perf_counter()
        assert len(outputs) == rows, "not a steady decode step"
        walls.append(now - last)
        devices.append(engine.device_seconds - device)
        hosts.append((engine.worker_seconds - worker_s) - (engine.device_seconds - device))
        last = now
    engine.abort_requests([f"r{i}" for i in range(rows)])
    while engine._in_flight is not None:  # let the last step in flight finish
        engine.step()
    med = statistics.median
    return dict(wall=med(walls), device=med(devices), host=med(hosts),
                overhead=med(w - d for w, d in zip(walls, devices)))


def plan_bytes() -> None:
    from jaxserve.plan_codec import plan_to_proto
    from jaxserve.worker.inputs import StepLayout

    print("decode step bytes: serialized StepPlan (no new rows, no appended blocks), and the "
          "worker's packed host->device buffer (T = R; the same for any context length, "
          "and for any max_num_seqs >= R):")
    for r in (1, 8, 64, 256):
        i32 = np.arange(r, dtype=np.int32)
        plan = StepPlan(1234, np.zeros(0, np.int32), (), np.zeros(0, np.int32),
                        np.zeros(0, np.int32), i32, i32 + 4000, np.ones(r, np.int32),
                        np.ones(r, np.bool_), 256, 256)
        upload = 4 * StepLayout.for_bucket(r, max(r, 256), 16).size
        print(f"  R = {r:3d}: plan {plan_to_proto(plan).ByteSize():5d} bytes, "
              f"upload {upload:5d} bytes")


def start_times(model: str | None, dtype: str, cache: str | None = None) -> None:
    from jaxserve.engine.grpc_worker import start_worker_process

    init = WorkerInit(model=model, dtype=dtype, block_size=16, num_kv_blocks=513,
                      kv_cache_bytes=None, max_num_seqs=64, max_model_len=1024,
                      token_buckets=T_LADDER, request_buckets=R_LADDER)
    cache = cache or tempfile.mkdtemp(prefix="jaxserve_cache_")
    for label in ("first start", "warm cache"):
        t0 = time.perf_counter()
        worker = start_worker_process(compilation_cache_dir=cache, log_level="WARNING")
        t1 = time.perf_counter()
        worker.initialize(init)
        t2 = time.perf_counter()
        s = worker.status()
        worker.shutdown()
        print(f"{label:11s}: ready in {t2 - t0:6.1f} s = process {t1 - t0:4.1f} s + initialize "
              f"{t2 - t1:6.1f} s (executables {s.compile_seconds:6.1f} s, "
              f"{s.num_cache_hits}/{s.num_executables} from the cache)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--transports", default="in_process,grpc")
    parser.add_argument("--plan-bytes", action="store_true")
    parser.add_argument("--start-times", action="store_true")
    parser.add_argument("--start-cache-dir", default=None,
                        help="an empty directory for --start-times (default: a new temporary one)")
    parser.add_argument("--model", default=None, help="a model directory (default: the demo)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-backend", default=None, help="default: the platform's")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.plan_bytes:
        plan_bytes()
    if args.start_times:
        start_times(args.model, args.dtype, args.start_cache_dir)
    rows = [int(r) for r in args.rows.split(",") if r]
    print("per decode step, ms (median): wall, device, overhead = wall - device, worker host")
    for transport in args.transports.split(","):
        if not transport:
            continue
        if transport == "grpc":
            from jaxserve.engine.grpc_worker import start_worker_process

            worker = start_worker_process(log_level="WARNING")
        else:
            from jaxserve.model.loader import load_model
            from jaxserve.worker import InProcessWorker

            loaded = load_model(args.model, args.dtype)
            worker = None
        try:
            for r in rows:
                for async_scheduling in (False, True):
                    w = worker if transport == "grpc" else InProcessWorker(loaded, progress=False)
                    m = measure(w, r, async_scheduling, args.steps, args.model, args.dtype,
                                args.attention_backend)
                    print(f"{transport:10s} R = {r:2d} {'async' if async_scheduling else 'sync ':5s}"
                          f"  wall {1e3 * m['wall']:7.2f}  device {1e3 * m['device']:7.2f}  "
                          f"overhead {1e3 * m['overhead']:6.2f}  worker host "
                          f"{1e3 * m['host']:5.2f}", flush=True)
        finally:
            if worker is not None:
                worker.shutdown()


if __name__ == "__main__":
    main()
