"""One GPU command: the kernel's achieved bandwidth and the served decode step, in one JSON.

For a session with a GPU for a few minutes (``scripts/gpu_measure.sh`` wraps
it with a time limit). In one process, in this order:

1. ``kernel``: ``benchmarks/kernels/bench_ragged_paged_attention.py`` on its
   quick grid — Llama-3-8B decode steps of 1 / 64 / 256 rows at 2k and 8k
   context, bfloat16, timed on the device (n and 2n calls chained in one
   jitted call) — each case's error against the jnp reference and the
   bandwidth of the ``CostEstimate`` bytes as a share of peak HBM, with the
   device's busy time per call from a ``jax.profiler`` trace beside it
   (``trace_us``; traces kept in ``kernel_trace/`` next to the JSON);
2. ``decode``: ``benchmarks/llama8b_decode.py`` — the worker's served step of
   a Llama-3-8B-shaped model (random weights) at each ``--decode-batch`` and
   ``--context``, synchronous and dispatched ahead, against the
   weight-streaming floor measured in the same run.

The JSON is rewritten after each section, so a run cut short keeps what it
finished; a section that raises is recorded as ``{"error": ...}`` and the
next one still runs. ``summary`` gathers the headline numbers: per kernel
case ``pct_of_peak`` and (chained, traced) µs, per decode step
``ratio_to_weight_floor``.

On a CPU the same code runs (kernel in interpret mode on the benchmark's CPU
cases; pass a narrowed model for the decode, as tests/benchmarks does): a
smoke test of the path, not a measurement.

Usage: python -m benchmarks.gpu_measure --json PATH [--peak-gbps GBPS]
       [--decode-batch 1,64] [--context 2048] [--skip-kernel] [--skip-decode]
Exit status 1 if a section failed or a kernel case disagreed with the reference.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback

import jax

from benchmarks import llama8b_decode
from benchmarks.kernels import bench_ragged_paged_attention as kernel_bench


def _write(path: str, result: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def _kernel_section(opts, on_gpu: bool) -> dict:
    dtype = opts.kernel_dtype or ("bfloat16" if on_gpu else "float32")
    trace_dir = os.path.join(os.path.dirname(os.path.abspath(opts.json)), "kernel_trace")
    rows = kernel_bench.run(dtype, opts.kernel_iters, opts.peak_gbps, quick=True,
                            time_on_cpu=not on_gpu, repeats=opts.kernel_repeats,
                            trace_dir=trace_dir)
    return dict(dtype=dtype, iters=opts.kernel_iters, trace_dir=trace_dir, cases=rows)


def _decode_section(opts) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama8b.json")
        args = ["--layers", str(opts.layers), "--hidden-scale", str(opts.hidden_scale),
                "--batch", opts.decode_batch, "--context", str(opts.context),
                "--backend", opts.backend, "--dtype", opts.dtype,
                "--iters", str(opts.decode_iters), "--json", path]
        code = llama8b_decode.main(args)
        with open(path) as f:
            out = json.load(f)
    if code:
        raise RuntimeError(f"llama8b_decode exited {code}")
    return out


def summarize(result: dict) -> dict:
    """Headline numbers of the sections that finished."""
    summary = {}
    kernel = result.get("kernel", {})
    if "cases" in kernel:
        summary["kernel_pct_of_peak"] = {r["case"]: r.get("pct_of_peak") for r in kernel["cases"]}
        summary["kernel_us"] = {r["case"]: (r.get("kernel_us"), r.get("trace_us"))
                                for r in kernel["cases"]}
        summary["kernel_agrees"] = all(r["agrees"] for r in kernel["cases"])
    decode = result.get("decode", {})
    if "steps" in decode:
        summary["decode_floor_ms"] = decode["floor_ms"]
        summary["decode_ratio_to_weight_floor"] = {
            key: step["ratio_to_weight_floor"] for key, step in decode["steps"].items()}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="the one output file")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="peak HBM bandwidth in GB/s (default: by device kind)")
    parser.add_argument("--kernel-dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--kernel-iters", type=int, default=8,
                        help="n: chains of n and 2n kernel calls (short: each call is one more "
                             "kernel in the compiled program)")
    parser.add_argument("--kernel-repeats", type=int, default=10)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden-scale", type=int, default=1, help="divide widths (smoke tests)")
    parser.add_argument("--decode-batch", default="1,64")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--decode-iters", type=int, default=20)
    parser.add_argument("--backend", default="pallas", help="the decode's attention backend")
    parser.add_argument("--dtype", default="bfloat16", help="the decode's dtype")
    parser.add_argument("--skip-kernel", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    opts = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    result = dict(started_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                  jax=jax.__version__, python=platform.python_version(), args=vars(opts),
                  wall_s={})
    print(f"{result['device']} ({result['backend']}), JAX {result['jax']}", flush=True)
    sections = [("kernel", lambda: _kernel_section(opts, on_gpu)),
                ("decode", lambda: _decode_section(opts))]
    failed = False
    for name, run in sections:
        if getattr(opts, f"skip_{name}"):
            continue
        start = time.perf_counter()
        try:
            result[name] = run()
        except Exception as err:  # noqa: BLE001 - record it; the next section still runs
            traceback.print_exc()
            result[name] = {"error": f"{type(err).__name__}: {err}"}
            failed = True
        result["wall_s"][name] = time.perf_counter() - start
        result["summary"] = summarize(result)
        _write(opts.json, result)
    failed |= not result.get("summary", {}).get("kernel_agrees", True)
    print(json.dumps(result.get("summary", {}), indent=1), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
