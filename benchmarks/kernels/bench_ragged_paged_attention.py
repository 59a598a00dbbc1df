"""Micro-benchmark of the ragged paged attention kernel, timed on the device.

On a GPU: times the Pallas kernel on Llama-3-8B-shaped decode steps (32 q
heads, 8 KV heads, head dim 128, bfloat16, block size 16; batch 1 / 8 / 64 /
256 rows at 2k and 8k context, T = rows) and one mixed step (decodes + a
prefill chunk), and reports the achieved bandwidth: the bytes the kernel's
``CostEstimate`` says one call moves (``rpa_kernel.cost_estimate``: K/V of
every live row at the block table's full context, q, the output or the
split-K partials, the block table) over the device time of one call, as a
share of the device's peak HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s,
by device kind; ``--peak-gbps`` overrides). The K/V bytes alone are reported
beside it. The device time comes from ``device_timing.device_seconds``: n and
2n calls chained inside one jitted call, ``(t(2n) - t(n)) / n`` — not one host
round trip per call, which on a GPU measures dispatch (that number is kept as
``host_sync_us`` for contrast); ``--trace DIR`` cross-checks it with the
device's busy time in a ``jax.profiler`` trace (``trace_us``). It also checks
the kernel against the jnp reference on every case.

On a CPU: the same code on two small demo-model shapes, the kernel in Pallas
interpret mode; it checks agreement, and with ``--time-on-cpu`` runs the
timing path (its numbers measure nothing). Exits 1 if any case disagrees
beyond the per-dtype bound.

Usage:
  python -m benchmarks.kernels.bench_ragged_paged_attention [--dtype bfloat16]
      [--iters 32] [--peak-gbps 3350] [--json results.json] [--quick] [--trace DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.device_timing import device_seconds
from pallas_kernels import rpa_kernel
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)
from pallas_kernels.tuning import TuningConfig, num_kv_splits, tuning_for

log = logging.getLogger("bench_rpa")

# Peak HBM bandwidth (bytes/s) by device kind, from the vendors' data sheets;
# the H100 SXM figure is memory_bandwidth in pallas_kernels/h100_target_config.pbtxt.
PEAK_HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12, "H20": 4.0e12}
# ‖kernel − reference‖ / ‖reference‖ bounds (the test suite's, doubled for
# the reference's own rounding).
AGREEMENT_BOUND = {"float32": 2e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    """One step: ``rows`` of (query tokens, cached context tokens), padded to T tokens."""

    name: str
    rows: tuple[tuple[int, int], ...]
    num_tokens: int  # T (bucket), >= total query tokens
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


DECODE_ROWS = (1, 8, 64, 256)
DECODE_CONTEXTS = (2048, 8192)
QUICK_ROWS = (1, 64, 256)


def gpu_cases(quick: bool) -> list[Case]:
    """Decode steps (T = R rows of one token at ``ctx`` tokens) and one mixed step.

    ``quick``: rows 1 / 64 / 256 only and no mixed step.
    """
    cases = []
    for ctx in DECODE_CONTEXTS:
        for rows in QUICK_ROWS if quick else DECODE_ROWS:
            cases.append(Case(f"decode_R{rows}_ctx{ctx}", ((1, ctx - 1),) * rows, rows))
    if not quick:  # decode rows plus one prefill chunk continuing after cached blocks
        cases.append(Case("mixed_224x2k+512@1k", ((1, 2047),) * 224 + ((512, 1024),), 1024))
    return cases


def cpu_cases() -> list[Case]:
    demo = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    return [Case("decode_R4_ctx300", ((1, 299),) * 4, 16, **demo),
            Case("mixed_3x100+24@32", ((1, 99),) * 3 + ((24, 32),), 32, **demo)]


def build(case: Case, dtype, key) -> tuple:
    """Random q / caches (on device) and metadata with shuffled blocks; block 0 is null."""
    s, mb = case.block_size, max_blocks(case)
    num_rows = len(case.rows)
    num_blocks = num_rows * mb + 1
    k1, k2, k3, k4 = jax.random.split(key, 4)
    shape = (num_blocks, case.num_kv_heads, s, case.head_dim)
    k_cache = jax.random.normal(k1, shape, dtype)
    v_cache = jax.random.normal(k2, shape, dtype)
    q = jax.random.normal(k3, (case.num_tokens, case.num_heads, case.head_dim), dtype)
    perm = 1 + np.asarray(jax.random.permutation(k4, num_blocks - 1))
    block_table = perm.reshape(num_rows, mb).astype(np.int32)
    seq_lens = np.array([q + c for q, c in case.rows], np.int32)
    qsl = np.concatenate([[0], np.cumsum([q for q, _ in case.rows])]).astype(np.int32)
    if qsl[-1] > case.num_tokens:
        raise ValueError(f"{case.name}: {qsl[-1]} query tokens exceed T={case.num_tokens}")
    return (q, k_cache, v_cache, jnp.asarray(block_table), jnp.asarray(seq_lens),
            jnp.asarray(qsl))


def max_blocks(case: Case) -> int:
    """MB: block-table columns, enough for the longest row."""
    return max(-(-(q + c) // case.block_size) for q, c in case.rows)


def cost_bytes(case: Case, dtype, tuning: TuningConfig | None = None) -> int:
    """Bytes one kernel call moves by its ``CostEstimate`` (same tuning, so same split count)."""
    dtype = jnp.dtype(dtype)
    mb = max_blocks(case)
    tuning = tuning or tuning_for(case.head_dim, case.block_size, dtype)
    splits = num_kv_splits(tuning, num_tokens=case.num_tokens, num_rows=len(case.rows),
                           num_kv_heads=case.num_kv_heads, max_context=mb * case.block_size)
    estimate = rpa_kernel.cost_estimate(
        num_tokens=case.num_tokens, num_rows=len(case.rows), num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, max_blocks=mb,
        block_size=case.block_size, itemsize=dtype.itemsize, num_splits=splits, soft_cap=False)
    return int(estimate.bytes_accessed)


def kv_bytes(case: Case, itemsize: int) -> int:
    """K/V bytes the step must read: every row's keys and values once."""
    tokens = sum(q + c for q, c in case.rows)
    return 2 * tokens * case.num_kv_heads * case.head_dim * itemsize


def peak_bandwidth(override_gbps: float | None) -> tuple[float, str]:
    if override_gbps:
        return override_gbps * 1e9, "--peak-gbps"
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_HBM_BYTES_PER_S.items():
        if name in kind:
            return peak, kind
    return PEAK_HBM_BYTES_PER_S["H100"], f"{kind} (unknown: H100 figure)"


def relative_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def run(dtype_name: str, iters: int, peak_gbps: float | None, quick: bool,
        time_on_cpu: bool = False, repeats: int = 5, trace_dir: str | None = None) -> list[dict]:
    """Runs every case; returns one dict per case (also printed as a line).

    On a GPU every case is timed (``iters`` = n of ``device_seconds``); on a
    CPU only with ``time_on_cpu`` (a test of the timing code, not a
    measurement). Times in µs, bandwidth in GB/s (1e9 bytes/s). With
    ``trace_dir``, each timed case's n-call chain is also traced (a folder
    per case): ``trace_us`` is the device's busy time per call, None
    where the trace has no device timeline (a CPU).
    """
    dtype = jnp.dtype(dtype_name)
    on_gpu = jax.default_backend() == "gpu"
    cases = gpu_cases(quick) if on_gpu else cpu_cases()
    timed = on_gpu or time_on_cpu
    peak, peak_source = peak_bandwidth(peak_gbps)
    results = []
    for i, case in enumerate(cases):
        args = build(case, dtype, jax.random.key(i))
        scale = case.head_dim ** -0.5

        def kernel(*a, scale=scale):
            return ragged_paged_attention(*a, sm_scale=scale, interpret=not on_gpu)

        out = jax.jit(kernel)(*args).astype(jnp.float32)
        ref = jax.jit(lambda *a, scale=scale: ragged_paged_attention_reference(
            *a, sm_scale=scale))(*args).astype(jnp.float32)
        row = {"case": case.name, "dtype": dtype_name, "T": case.num_tokens,
               "rows": len(case.rows), "context": max(q + c for q, c in case.rows),
               "error": relative_error(out, ref)}
        row["agrees"] = row["error"] < AGREEMENT_BOUND[dtype_name]
        del out, ref
        if timed:
            case_trace = os.path.join(trace_dir, case.name) if trace_dir else None
            timing = device_seconds(kernel, args[0], args[1:], iters=iters, repeats=repeats,
                                    trace_dir=case_trace)
            moved, kv = cost_bytes(case, dtype), kv_bytes(case, dtype.itemsize)
            sec = timing.seconds
            row.update(cost_bytes=moved, kv_bytes=kv, kernel_us=sec * 1e6,
                       chain_us=timing.chain_seconds * 1e6,
                       host_sync_us=timing.host_sync_seconds * 1e6,
                       iters=timing.iters, differential=timing.differential,
                       achieved_gbps=moved / sec / 1e9, pct_of_peak=100 * moved / sec / peak,
                       kv_pct_of_peak=100 * kv / sec / peak,
                       peak_gbps=peak / 1e9, peak_source=peak_source)
            if trace_dir:
                traced = timing.trace_seconds
                row["trace_us"] = None if traced is None else traced * 1e6
        results.append(row)
        print(_format(row), flush=True)
        del args
    return results


def _format(row: dict) -> str:
    text = f"{row['case']:<24} {row['dtype']:<9} T={row['T']:<5} err={row['error']:.2e}"
    text += "" if row["agrees"] else "  DISAGREES"
    if "kernel_us" in row:
        text += (f"  kernel {row['kernel_us']:9.1f} us (host-synced {row['host_sync_us']:9.1f})"
                 f"  {row['achieved_gbps']:7.0f} GB/s = {row['pct_of_peak']:5.1f}% of peak"
                 f" (K/V alone {row['kv_pct_of_peak']:5.1f}%)")
    if row.get("trace_us") is not None:
        text += f"  trace {row['trace_us']:9.1f} us"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--iters", type=int, default=None,
                        help="n: chains of n and 2n calls (default 32 on GPU, 1 on CPU)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each chain")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="peak HBM bandwidth in GB/s (default: by device kind)")
    parser.add_argument("--quick", action="store_true",
                        help="GPU: rows 1 / 64 / 256 at 2k and 8k, no mixed step")
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--trace", default=None,
                        help="also profile each case's chain into this folder (trace_us)")
    parser.add_argument("--time-on-cpu", action="store_true",
                        help="time the interpret-mode kernel too (tests the timing code)")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("jax").setLevel(logging.WARNING)
    dtype = opts.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    log.info("backend %s, device %s", jax.default_backend(), jax.devices()[0].device_kind)
    iters = opts.iters or (32 if jax.default_backend() == "gpu" else 1)
    results = run(dtype, iters, opts.peak_gbps, opts.quick, opts.time_on_cpu, opts.repeats,
                  opts.trace)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["agrees"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
