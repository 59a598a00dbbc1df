"""The kernel micro-benchmark runs on the CPU (interpret mode) and its numbers add up."""

import json

import jax
import pytest

from benchmarks.kernels import bench_ragged_paged_attention as bench


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU path of the benchmark")
def test_benchmark_cpu_path(tmp_path):
    out = tmp_path / "rpa.json"
    assert bench.main(["--iters", "1", "--time-on-cpu", "--peak-gbps", "30",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == [c.name for c in bench.cpu_cases()]
    for row, case in zip(rows, bench.cpu_cases()):
        assert row["agrees"] and row["error"] < bench.AGREEMENT_BOUND["float32"]
        assert row["kv_bytes"] == bench.kv_bytes(case, 4)
        # achieved bandwidth and share of the floor are the same measurement
        floor_s = row["kv_bytes"] / 30e9
        assert row["pct_of_hbm_floor"] == pytest.approx(100 * floor_s / (row["kernel_us"] * 1e-6))


def test_kv_bytes_counts_every_row_once():
    case = bench.Case("x", ((1, 99), (24, 32)), 32, num_heads=9, num_kv_heads=3, head_dim=64)
    assert bench.kv_bytes(case, 2) == 2 * (100 + 56) * 3 * 64 * 2
