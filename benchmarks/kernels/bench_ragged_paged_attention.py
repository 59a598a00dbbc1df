"""Micro-benchmark of the ragged paged attention kernel.

On a GPU: times the Pallas kernel (and, for scale, the jnp reference) on
Llama-3-8B-shaped decode and mixed (decode + prefill chunk) steps and reports
the achieved bandwidth as a share of the HBM floor: K/V bytes that must be read
(every row's ``seq_len`` tokens x K heads x H x 2 arrays, once) divided by the
kernel's median time, against the device's peak HBM bandwidth. It also checks
that the kernel agrees with the reference on every case.

On a CPU: runs the same kernel in Pallas interpret mode on small demo-model
shapes and checks its agreement with the reference (time is not meaningful
there). Exits 1 if any case disagrees beyond the per-dtype bound.

Usage:
  python benchmarks/kernels/bench_ragged_paged_attention.py [--dtype bfloat16]
      [--iters 20] [--peak-gbps 3350] [--json results.json] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)

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


def gpu_cases(quick: bool) -> list[Case]:
    cases = []
    for rows, ctx in ((1, 8192), (8, 4096), (32, 2048), (128, 2048), (256, 2048), (256, 4096)):
        if quick and rows not in (8, 256):
            continue
        t = max(16, 1 << (rows - 1).bit_length())
        cases.append(Case(f"decode_R{rows}_ctx{ctx}", ((1, ctx - 1),) * rows, t))
    # Mixed: decode rows plus one prefill chunk continuing after cached blocks.
    cases.append(Case("mixed_224x2k+512@1k", ((1, 2047),) * 224 + ((512, 1024),), 1024))
    if not quick:
        cases.append(Case("mixed_64x4k+1536@0", ((1, 4095),) * 64 + ((1536, 0),), 2048))
    return cases


def cpu_cases() -> list[Case]:
    demo = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    return [Case("decode_R4_ctx300", ((1, 299),) * 4, 16, **demo),
            Case("mixed_3x100+24@32", ((1, 99),) * 3 + ((24, 32),), 32, **demo)]


def build(case: Case, dtype, key) -> tuple:
    """Random q / caches (on device) and metadata with shuffled blocks; block 0 is null."""
    s, mb = case.block_size, max(-(-(q + c) // case.block_size) for q, c in case.rows)
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


def kv_bytes(case: Case, itemsize: int) -> int:
    """K/V bytes the step must read: every row's keys and values once."""
    tokens = sum(q + c for q, c in case.rows)
    return 2 * tokens * case.num_kv_heads * case.head_dim * itemsize


def median_seconds(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
        time_on_cpu: bool = False) -> list[dict]:
    """Runs every case; returns one dict per case (also printed as a line).

    On a CPU, ``time_on_cpu`` also times the interpret-mode kernel (a smoke
    test of the timing code, not a measurement).
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
        kernel = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale,
                                                           interpret=not on_gpu))
        reference = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=scale))
        out, ref = kernel(*args).astype(jnp.float32), reference(*args).astype(jnp.float32)
        row = {"case": case.name, "dtype": dtype_name, "T": case.num_tokens,
               "rows": len(case.rows), "error": relative_error(out, ref)}
        row["agrees"] = row["error"] < AGREEMENT_BOUND[dtype_name]
        if timed:
            t_kernel = median_seconds(kernel, args, iters)
            t_ref = median_seconds(reference, args, max(3, iters // 4))
            nbytes = kv_bytes(case, dtype.itemsize)
            row.update(kv_bytes=nbytes, kernel_us=t_kernel * 1e6, reference_us=t_ref * 1e6,
                       achieved_gbps=nbytes / t_kernel / 1e9,
                       hbm_floor_us=nbytes / peak * 1e6,
                       pct_of_hbm_floor=100 * (nbytes / peak) / t_kernel,
                       peak_source=peak_source)
        results.append(row)
        print(_format(row), flush=True)
    return results


def _format(row: dict) -> str:
    text = f"{row['case']:<24} {row['dtype']:<9} T={row['T']:<5} err={row['error']:.2e}"
    text += "" if row["agrees"] else "  DISAGREES"
    if "kernel_us" in row:
        text += (f"  kernel {row['kernel_us']:9.1f} us  ref {row['reference_us']:9.1f} us"
                 f"  {row['achieved_gbps']:7.0f} GB/s"
                 f" = {row['pct_of_hbm_floor']:5.1f}% of HBM floor"
                 f" ({row['hbm_floor_us']:.1f} us)")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="peak HBM bandwidth in GB/s (default: by device kind)")
    parser.add_argument("--quick", action="store_true", help="fewer GPU cases")
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--time-on-cpu", action="store_true",
                        help="time the interpret-mode kernel too (tests the timing code)")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("jax").setLevel(logging.WARNING)
    dtype = opts.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    log.info("backend %s, device %s", jax.default_backend(), jax.devices()[0].device_kind)
    results = run(dtype, opts.iters, opts.peak_gbps, opts.quick, opts.time_on_cpu)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["agrees"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
