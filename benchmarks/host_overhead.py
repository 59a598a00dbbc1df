"""The host's share of a step: the engine loop and the gRPC hop against a null worker.

    python -m benchmarks.host_overhead [--rows 1,64,256] [--steps 400] [--warmup 50]
        [--modes async,sync] [--outputs queue,stream] [--results DIR]

A worker process with no model (``benchmarks.null_worker``: the real worker
server and protocol, each plan answered at once) stands in for the device,
so every millisecond of a step is the host's: the engine loop
(``EngineLoop``: scheduling, plan building, token processing, the outputs
published to a subscriber), the plan and result codecs and the gRPC round
trip, and the worker server's own handling. The outputs go to a subscriber
queue in this process (``queue``) or over the engine's gRPC ``StreamOutputs``
(``EngineServer``) to a client standing for the api process (``stream``, as
``jaxserve serve`` runs; the client counts the outputs without turning them
back into ``EngineCoreOutput``s). For each output path, each scheduling mode
(async, the default, and sync) and each R, R requests decode together in
steady state (``max_num_seqs`` 256, prompts of 32 tokens, ``max_tokens``
long enough that no sequence finishes; a block boundary crossed every 16
steps) and the benchmark reports per step:

- ``steps_per_s``: steps published per second of wall time;
- ``host_ms``: the interval between consecutive steps' outputs reaching the
  subscriber, mean / p50 / p99, milliseconds — the step time a device step
  of zero would get, so a device step longer than it never waits for the host;
- ``engine_cpu_ms`` / ``worker_cpu_ms``: CPU time per step of the engine
  process (this one: the loop, the gRPC client and server, the subscriber) and of the
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

import grpc
import numpy as np

from benchmarks import null_worker
from benchmarks.common import environment, percentiles, write_json
from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.grpc_worker import attach_worker_process
from jaxserve.engine.loop import EngineLoop
from jaxserve.engine.service import EngineServer
from jaxserve.proto import engine_pb2 as epb
from jaxserve.proto import engine_pb2_grpc as epb_grpc
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


def _queue_batches(loop: EngineLoop):
    """(outputs, error) of each step, from a subscriber queue of ``loop`` (in this process)."""
    q = loop.subscribe()
    while True:
        batch = q.get(timeout=60.0)
        yield len(batch.outputs), batch.error


def _stream_batches(port: int, calls: list):
    """(outputs, error) of each ``StreamOutputs`` message from the engine server on ``port``.

    The api process's side of the stream, minus turning the outputs back into
    ``EngineCoreOutput``s (that is the api process's work). A message holds
    every step published since the previous one.
    """
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = epb_grpc.EngineServiceStub(channel).StreamOutputs(epb.StreamOutputsRequest())
    calls.append((channel, call))
    next(call)  # the empty message that confirms the subscription
    for message in call:
        yield len(message.outputs), message.error


def measure(rows: int, async_scheduling: bool, steps: int, warmup: int,
            stream: bool = False) -> dict:
    """One run: ``rows`` sequences decoding for ``warmup`` + ``steps`` steps; see the module doc.

    Args:
      stream: the outputs go to an api-process client over the engine's gRPC
        ``StreamOutputs`` (``EngineServer``), else to a subscriber queue.

    Returns:
      a dict of the figures (see the module docstring) plus ``rows``, ``mode``,
      ``outputs``, ``steps``.

    Raises:
      RuntimeError: the engine failed, or a step's outputs did not cover every row.
    """
    max_model_len = PROMPT_LEN + warmup + steps + 128  # room for merged messages
    blocks_per_seq = -(-max_model_len // BLOCK_SIZE)
    config = EngineConfig(
        max_model_len=max_model_len, async_scheduling=async_scheduling,
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS,
                                  max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS),
        cache=CacheConfig(block_size=BLOCK_SIZE,
                          num_kv_blocks=MAX_NUM_SEQS * blocks_per_seq + 1))
    worker = attach_worker_process(null_worker.spawn(), start_timeout=60.0)
    core = EngineCore(config, worker)
    rng = np.random.default_rng(rows)
    params = SamplingParams(max_tokens=max_model_len - PROMPT_LEN, ignore_eos=True)
    prompts = rng.integers(1, null_worker.VOCAB_SIZE, (rows, PROMPT_LEN)).tolist()
    for i, prompt in enumerate(prompts):  # added before the loop runs
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
    calls: list = []
    if stream:
        server = EngineServer(core, "127.0.0.1:0")
        loop = server.loop
        server.start()
        batches = _stream_batches(server.port, calls)
    else:
        loop = EngineLoop(core)
        batches = _queue_batches(loop)
        loop.start()
    try:
        intervals: list[float] = []  # ms per step
        seen = 0  # steps received
        start = last = 0.0
        cpu = {}
        for num_outputs, error in batches:
            if error:
                raise RuntimeError(f"the engine failed: {error}")
            now = time.perf_counter()
            k = max(num_outputs // rows, 1)  # steps in this message
            seen += k
            if seen <= warmup:
                last = now
                continue
            if num_outputs % rows or not num_outputs:
                raise RuntimeError(f"{num_outputs} outputs for {rows} decoding rows "
                                   f"(a row not decoding?)")
            if not cpu:  # the first measured message starts the clocks
                start = last = now
                cpu = {"engine": time.process_time(), "worker": _process_cpu_seconds(worker.pid)}
                measured = 0
                continue
            intervals.extend([(now - last) * 1e3 / k] * k)
            last = now
            measured += k
            if measured >= steps:
                break
        engine_cpu = time.process_time() - cpu["engine"]
        worker_cpu = _process_cpu_seconds(worker.pid) - cpu["worker"]
        loop.stop()  # the counts below are read off a stopped loop
        engine_steps, worker_steps = core.num_steps, worker.status().num_steps
    finally:
        for channel, call in calls:
            call.cancel()
            channel.close()
        if stream:
            server.stop(grace=0.0)
        else:
            loop.stop()
            core.shutdown()
    host_ms = percentiles(intervals, (50, 99))
    return {
        "rows": rows, "mode": "async" if async_scheduling else "sync",
        "outputs": "stream" if stream else "queue", "steps": measured,
        "steps_per_s": measured / (last - start),
        **{f"host_ms_{k}": v for k, v in host_ms.items()},
        "engine_cpu_ms": engine_cpu / measured * 1e3,
        "worker_cpu_ms": worker_cpu / measured * 1e3,
        "engine_steps": engine_steps, "worker_steps": worker_steps,
    }


def table(runs: list[dict]) -> str:
    lines = [f"{'mode':6s} {'outputs':7s} {'R':>4s} {'steps/s':>8s} {'host ms mean':>12s} "
             f"{'p50':>6s} {'p99':>6s} {'engine cpu ms':>13s} {'worker cpu ms':>13s}"]
    for r in runs:
        lines.append(f"{r['mode']:6s} {r['outputs']:7s} {r['rows']:4d} {r['steps_per_s']:8.0f} "
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
    parser.add_argument("--outputs", default="queue,stream",
                        help="where the outputs go: queue (a subscriber in the engine "
                             "process), stream (an api client over gRPC StreamOutputs), or both")
    parser.add_argument("--results", default="results", help="folder for host_overhead.json")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    outputs = [o.strip() for o in args.outputs.split(",")]
    if not all(1 <= r <= MAX_NUM_SEQS for r in rows):
        parser.error(f"--rows must be in [1, {MAX_NUM_SEQS}]")
    if not set(modes) <= {"async", "sync"}:
        parser.error("--modes takes async and/or sync")
    if not set(outputs) <= {"queue", "stream"}:
        parser.error("--outputs takes queue and/or stream")
    if args.steps < 2 or args.warmup < 2:
        parser.error("--steps and --warmup must be >= 2")
    runs = [measure(r, mode == "async", args.steps, args.warmup, out == "stream")
            for out in outputs for mode in modes for r in rows]
    print(table(runs))
    results = {"benchmark": "host_overhead", "args": vars(args), "environment": environment(),
               "max_num_seqs": MAX_NUM_SEQS, "prompt_len": PROMPT_LEN, "runs": runs}
    write_json(args.results, "host_overhead", results)
    return results


if __name__ == "__main__":
    main()
