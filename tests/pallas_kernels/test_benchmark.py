"""The kernel micro-benchmark runs on the CPU (interpret mode) and its numbers add up."""

import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kernels import bench_ragged_paged_attention as bench
from benchmarks.kernels import device_timing


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU path of the benchmark")
def test_benchmark_cpu_path(tmp_path):
    out = tmp_path / "rpa.json"
    assert bench.main(["--iters", "1", "--repeats", "1", "--time-on-cpu", "--peak-gbps", "30",
                       "--json", str(out), "--trace", str(tmp_path / "trace")]) == 0
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == [c.name for c in bench.cpu_cases()]
    for row, case in zip(rows, bench.cpu_cases()):
        assert row["agrees"] and row["error"] < bench.AGREEMENT_BOUND["float32"]
        assert row["kv_bytes"] == bench.kv_bytes(case, 4)
        assert row["cost_bytes"] == bench.cost_bytes(case, jnp.float32) >= row["kv_bytes"]
        assert row["iters"] == 1 and row["peak_gbps"] == 30 and row["peak_source"] == "--peak-gbps"
        # achieved bandwidth and share of peak are one measurement of the estimate's bytes
        sec = row["kernel_us"] * 1e-6
        assert row["achieved_gbps"] == pytest.approx(row["cost_bytes"] / sec / 1e9)
        assert row["pct_of_peak"] == pytest.approx(100 * row["cost_bytes"] / sec / 30e9)
        assert row["kv_pct_of_peak"] == pytest.approx(100 * row["kv_bytes"] / sec / 30e9)
        if not row["differential"]:
            assert row["kernel_us"] == row["chain_us"]
        assert row["trace_us"] is None  # a CPU trace has no device timeline
        assert list((tmp_path / "trace" / case.name).rglob("*.trace.json.gz"))


def test_gpu_cases_are_the_llama3_8b_decode_grid():
    cases = bench.gpu_cases(quick=False)
    decode = [c for c in cases if c.name.startswith("decode")]
    assert [(len(c.rows), c.rows[0][0] + c.rows[0][1]) for c in decode] == [
        (r, ctx) for ctx in (2048, 8192) for r in (1, 8, 64, 256)]
    for c in decode:
        assert (c.num_heads, c.num_kv_heads, c.head_dim, c.block_size) == (32, 8, 128, 16)
        assert c.num_tokens == len(c.rows)  # T = R: the served decode step
    quick = bench.gpu_cases(quick=True)
    assert [c.name for c in quick] == [f"decode_R{r}_ctx{ctx}" for ctx in (2048, 8192)
                                       for r in (1, 64, 256)]


def test_cost_bytes_is_the_kernels_estimate():
    # Llama-3-8B, 64 decode rows at 8k: K/V of every row at full context dominate.
    case = bench.Case("x", ((1, 8191),) * 64, 64)
    kv = 2 * 64 * 8 * 8192 * 128 * 2
    assert bench.kv_bytes(case, 2) == kv
    nbytes = bench.cost_bytes(case, jnp.bfloat16)
    assert kv < nbytes < 1.01 * kv


def test_kv_bytes_counts_every_row_once():
    case = bench.Case("x", ((1, 99), (24, 32)), 32, num_heads=9, num_kv_heads=3, head_dim=64)
    assert bench.kv_bytes(case, 2) == 2 * (100 + 56) * 3 * 64 * 2


def test_chain_runs_every_call_in_order():
    """Each call sees the previous output (eps != 0) and with eps = 0 gives fn's own result."""
    def fn(q, w):
        return jnp.tanh(q @ w)

    q = jax.random.normal(jax.random.key(0), (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 8))
    out = device_timing.chain(fn, 3)(q, w, jnp.float32(0.5))
    want = q
    for _ in range(3):
        last = np.tanh(np.asarray(want) @ np.asarray(w))
        want = want + 0.5 * last
    np.testing.assert_allclose(out, last, rtol=1e-5, atol=1e-5)
    same = device_timing.chain(fn, 3)(q, w, jnp.float32(0.0))
    np.testing.assert_allclose(same, jnp.tanh(q @ w), rtol=1e-6, atol=1e-6)
    # unrolled: three calls in one executable, no while loop for the device to run
    hlo = device_timing.chain(fn, 3).lower(q, w, jnp.float32(0.0)).compile().as_text()
    assert "while" not in hlo
    if jax.default_backend() == "cpu":  # a GPU lowers the dot to a library call
        assert hlo.count(" dot(") == 3


def test_device_seconds_fields(tmp_path):
    timing = device_timing.device_seconds(lambda q, w: jnp.tanh(q @ w), jnp.ones((8, 8)),
                                          (jnp.eye(8),), iters=2, repeats=1,
                                          trace_dir=str(tmp_path))
    assert timing.iters == 2 and timing.seconds > 0 and timing.host_sync_seconds > 0
    assert timing.chain_seconds > 0
    assert timing.differential or timing.seconds == timing.chain_seconds
    if jax.default_backend() == "cpu":  # the trace was taken; it has no device timeline
        assert timing.trace_seconds is None and list(tmp_path.rglob("*.trace.json.gz"))


def test_device_busy_seconds_reads_device_timelines_only(tmp_path):
    """A hand-made trace: the GPU stream's two events count; derived lines and the host's do not."""
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "ragged_paged_attention_m16", "ts": 0, "dur": 30},
        {"ph": "X", "pid": 1, "tid": 7, "name": "loop_add_fusion", "ts": 30, "dur": 2.5},
        {"ph": "X", "pid": 1, "tid": 8, "name": "custom-call.1", "ts": 0, "dur": 30},
        {"ph": "X", "pid": 2, "tid": 1, "name": "ExecuteOnStream", "ts": 0, "dur": 500},
    ]
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert device_timing.device_busy_seconds(str(tmp_path)) == (pytest.approx(32.5e-6), 2)
    events = [e for e in events if e["pid"] == 2]
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert device_timing.device_busy_seconds(str(tmp_path)) is None
    assert device_timing.device_busy_seconds(str(tmp_path / "none")) is None
