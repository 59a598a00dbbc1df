"""One-shot GPU diagnosis: where a Llama-3-8B-shaped decode step spends its time.

For a lent GPU with little device time: in one process it (1) times the
batch-1 decode step with the Pallas and the jnp-reference attention,
(2) profiles a few Pallas steps with ``jax.profiler`` and prints the device
kernels by total time, and (3) sweeps kernel tunings on decode shapes, timed on the
device (``benchmarks/kernels/device_timing.py``: many calls chained in one
jitted call, not one host round trip per call), printing the bandwidth of
the kernel's ``CostEstimate`` bytes against the measured streaming rate and
the device's peak.

Usage: python -m benchmarks.gpu_diagnose --out DIR [--layers 32] [--hidden-scale 1]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import sys

import jax
import jax.numpy as jnp
from benchmarks.kernels import bench_ragged_paged_attention as bench
from benchmarks.kernels.device_timing import device_seconds
from benchmarks.llama8b_decode import decode_step_seconds, llama3_8b, measure_bandwidth, random_state
from jaxserve.model.loader import param_bytes
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.tuning import tuning_for


def profile_top_kernels(trace_dir: str, top: int = 25) -> list[tuple[str, float, int]]:
    """(name, total µs, count) of device-side trace events, largest first."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return []
    with gzip.open(max(files, key=os.path.getmtime), "rt") as f:
        trace = json.load(f)
    pid_names = {e["pid"]: e["args"].get("name", "") for e in trace.get("traceEvents", [])
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {p for p, n in pid_names.items() if "GPU" in n or "gpu" in n or "device" in n}
    if not device_pids:  # CPU runs: take everything but the python host threads
        device_pids = set(pid_names)
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("pid") in device_pids:
            t = totals[e["name"][:90]]
            t[0] += float(e.get("dur", 0.0))
            t[1] += 1
    rows = sorted(((n, v[0], v[1]) for n, v in totals.items()), key=lambda r: -r[1])
    return rows[:top]


def kernel_sweep(bandwidth: float, iters: int = 32) -> list[dict]:
    """Times tuning variants of the Pallas kernel on Llama-3-8B decode shapes, on the device.

    Each variant's time is ``device_timing.device_seconds`` (n and 2n calls
    chained in one jitted call); its bytes are the kernel's ``CostEstimate``
    for that variant. ``floor_share`` is against ``bandwidth`` (measured in
    this run), ``pct_of_peak`` against the device kind's peak.
    """
    peak, _ = bench.peak_bandwidth(None)
    out = []
    for rows, ctx in ((1, 2048), (8, 4096), (64, 2048)):
        case = bench.Case(f"decode_R{rows}_ctx{ctx}", ((1, ctx - 1),) * rows, rows)
        args = bench.build(case, jnp.bfloat16, jax.random.key(rows))
        base = tuning_for(case.head_dim, case.block_size, jnp.bfloat16)
        # Decode-shaped steps: the sweep varies the decode launch (TuningConfig.launch).
        now = base.launch(rows)
        variants = [base] + [
            dataclasses.replace(base, decode_block_kv=bkv, decode_num_stages=st, k_splits=ks,
                                decode_num_warps=nw)
            for bkv in (64, 128) for st in (2, 3, 4) for ks in (0, 8) for nw in (4,)
            if (bkv, st, ks, nw) != (now.block_kv, now.num_stages, base.k_splits, now.num_warps)]
        for tune in variants:
            launch = tune.launch(rows)
            def kernel(*a, tune=tune):
                return ragged_paged_attention(*a, sm_scale=case.head_dim ** -0.5, tuning=tune)

            try:
                timing = device_seconds(kernel, args[0], args[1:], iters=iters, repeats=3)
            except Exception as err:  # noqa: BLE001 - a variant may not compile; report it
                print(f"R{rows} ctx{ctx} {tune}: failed: {str(err)[:120]}", flush=True)
                continue
            sec, moved = timing.seconds, bench.cost_bytes(case, jnp.bfloat16, tune)
            row = dict(rows=rows, ctx=ctx, block_kv=launch.block_kv, num_stages=launch.num_stages,
                       k_splits=tune.k_splits, num_warps=launch.num_warps, us=sec * 1e6,
                       host_sync_us=timing.host_sync_seconds * 1e6, cost_bytes=moved,
                       floor_share=moved / bandwidth / sec, pct_of_peak=100 * moved / peak / sec)
            out.append(row)
            print(f"R{rows:3d} ctx{ctx} bkv{launch.block_kv:4d} st{launch.num_stages} "
                  f"ks{tune.k_splits:3d} nw{launch.num_warps}: {sec * 1e6:8.1f} us  {row['floor_share'] * 100:5.1f}% of "
                  f"floor, {row['pct_of_peak']:5.1f}% of peak", flush=True)
        del args
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden-scale", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--skip-sweep", action="store_true")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dtype = jnp.bfloat16
    config = llama3_8b(args.layers, args.hidden_scale)
    graphdef, state = random_state(config, dtype)
    weights = param_bytes(state)
    bandwidth = measure_bandwidth(min(4 << 30, max(64 << 20, weights // 2)))
    floor = weights / bandwidth
    report = dict(device=jax.devices()[0].device_kind, weight_bytes=weights,
                  bandwidth=bandwidth, floor_ms=floor * 1e3)
    print(f"{report['device']}: floor {floor * 1e3:.2f} ms ({weights / 1e9:.2f} GB at "
          f"{bandwidth / 1e12:.2f} TB/s)", flush=True)
    gpu = jax.default_backend() == "gpu"
    for backend in (("pallas", "reference") if gpu else ("reference",)):
        sec = decode_step_seconds(config, graphdef, state, batch=1, context=args.context,
                                  block_size=16, backend=backend, iters=10)
        report[f"batch1_{backend}_ms"] = sec * 1e3
        print(f"batch 1, {backend}: {sec * 1e3:.2f} ms/step = {sec / floor:.2f}x floor", flush=True)
    trace_dir = os.path.join(args.out, "trace")
    with jax.profiler.trace(trace_dir):
        decode_step_seconds(config, graphdef, state, batch=1, context=args.context, block_size=16,
                            backend="pallas" if gpu else "reference", iters=3)
    top = profile_top_kernels(trace_dir)
    steps = 6  # 3 warm-up + 3 timed steps ran under the profiler
    print("device time per step by kernel (µs):", flush=True)
    for name, total, count in top:
        print(f"  {total / steps:9.1f}  x{count // steps:4d}  {name}", flush=True)
    report["top_kernels"] = top
    if gpu and not args.skip_sweep:
        del state
        report["sweep"] = kernel_sweep(bandwidth)
    with open(os.path.join(args.out, "diagnose.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
