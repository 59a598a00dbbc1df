"""Each benchmark end to end with tiny settings (``jaxserve bench <name>`` in a subprocess).

The tiny random-weight Llama keeps compiles short; the checks are on the
JSON each run writes, against independent facts (the workload's own token
counts, the model's parameter count from PyTorch, the engine's step count).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks import BENCHMARKS
from jaxserve import bench

REPO = pathlib.Path(__file__).resolve().parents[2]
ENGINE = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None  # plots are optional


def run_bench(name: str, results: pathlib.Path, *args: str, timeout: float = 600) -> dict:
    cmd = [sys.executable, "-m", "jaxserve", "bench", name, "--results", str(results), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads((results / f"{name}.json").read_text())


def test_cli_lists_every_benchmark():
    assert tuple(bench.NAMES) == BENCHMARKS


def test_offline_throughput(tiny_model_dir, tmp_path):
    out = run_bench("offline_throughput", tmp_path, "--model", str(tiny_model_dir),
                    "--num-requests", "3", "--input-range", "8", "40", "--output-range", "4", "12",
                    "--hf-batch-size", "2", *ENGINE)
    want = out["workload"]["output_tokens"]
    jax_leg, hf_leg = out["legs"]["jaxserve"], out["legs"]["transformers"]
    for leg in (jax_leg, hf_leg):
        assert leg["output_tokens"] == want
        assert leg["output_tokens_per_s"] == pytest.approx(want / leg["elapsed"])
    assert hf_leg["computed_tokens"] >= want
    assert out["ratios"]["jaxserve_over_transformers"] == pytest.approx(
        jax_leg["output_tokens_per_s"] / hf_leg["output_tokens_per_s"])
    assert jax_leg["compiles"] == 0  # the warm-up compiled everything the timed run needed
    assert "error" in out["legs"]["vllm"] or "jaxserve_over_vllm" in out["ratios"]
    assert (tmp_path / "offline_throughput.png").exists() or not HAVE_MATPLOTLIB


def test_step_profile(tiny_model_dir, tmp_path):
    out = run_bench("step_profile", tmp_path, "--model", str(tiny_model_dir), "--num-requests", "3",
                    "--input-range", "8", "40", "--output-range", "4", "8", *ENGINE)
    profile = out["profile"]
    assert profile["categorized_by"] == "hlo dump"
    assert profile["num_steps"] == out["jaxserve"]["steps"]  # one body execution per engine step
    assert profile["step_marks"] == out["jaxserve"]["steps"]  # one worker.execute per step
    assert {s["num_tokens"] for s in profile["steps"]} <= {1, 4, 8, 16, 32, 64}  # the T ladder
    assert sum(profile["percent_of_wall"].values()) == pytest.approx(100, abs=0.1)
    for category in ("attention", "matmul", "kv_write", "sampler", "host_gap"):
        assert profile["totals_ms"][category] > 0, category
    assert list(pathlib.Path(profile["trace"]).parent.glob("*.trace.json.gz"))


def test_decode_roofline(tiny_model_dir, tmp_path):
    import torch
    import transformers

    out = run_bench("decode_roofline", tmp_path, "--model", str(tiny_model_dir), "--steps", "8",
                    "--warmup-steps", "2", "--bandwidth-mib", "64", "--bandwidth-reps", "3",
                    *ENGINE)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    num_params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()  # untied: gathered, not streamed
    assert out["weights"]["num_params"] == num_params
    assert out["weights"]["decode_bytes"] == 4 * (num_params - embed)
    assert out["floor_ms"] == pytest.approx(
        1e3 * out["weights"]["decode_bytes"] / (out["bandwidth"]["best_gb_s"] * 1e9))
    assert 0 < out["roofline_ratio"] < 1.5
    assert out["decode"]["steps"] == 8


def test_serving_against_jaxserve_serve(tiny_model_dir, tmp_path):
    out = run_bench("serving", tmp_path, "--model", str(tiny_model_dir), "--num-requests", "4",
                    "--input-range", "8", "40", "--output-range", "4", "8", "--request-rate", "4",
                    "--concurrency", "2", "--serve-args", " ".join(ENGINE))
    names = [s["name"] for s in out["scenarios"]]
    assert names == ["poisson@4/s", "max", "concurrency=2"]
    for s in out["scenarios"]:
        m = s["summary"]
        assert m["failed"] == 0 and m["completed"] == s["num_requests"]
        assert m["output_tokens"] == s["workload"]["output_tokens"]
        assert m["ttft_ms"]["p50"] <= m["e2e_ms"]["p50"]
    assert out["server"]["started_here"]
    assert (tmp_path / "serving_latency_cdf.png").exists() or not HAVE_MATPLOTLIB


def test_serving_over_the_openai_http_api(tiny_model_dir, tmp_path):
    """The load generator's HTTP mode: streamed /v1/completions, exact token totals from usage."""
    out = run_bench("serving", tmp_path, "--model", str(tiny_model_dir), "--num-requests", "4",
                    "--input-range", "8", "40", "--output-range", "4", "8", "--request-rate", "0",
                    "--no-max", "--concurrency", "2", "--backend", "openai",
                    "--serve-args", " ".join(ENGINE))
    (scenario,) = out["scenarios"]
    m = scenario["summary"]
    assert m["failed"] == 0 and m["completed"] == scenario["num_requests"]
    assert m["output_tokens"] == scenario["workload"]["output_tokens"]
    assert out["args"]["backend"] == "openai" and out["server"]["target"].startswith("http://")


def test_llama8b_decode_narrowed(tmp_path):
    """The GPU benchmark's code path on the CPU: 2 layers, widths / 8, reference attention.

    The served step (``InProcessWorker``) at batch 1 and 4, both modes; the
    scanned-layer worker is covered by tests/worker (a second run here would
    double this test's ~35 s).
    """
    path = tmp_path / "llama8b.json"
    cmd = [sys.executable, "-m", "benchmarks.llama8b_decode", "--layers", "2", "--hidden-scale",
           "8", "--backend", "reference", "--dtype", "float32", "--batch", "1,4", "--context",
           "64", "--iters", "5", "--json", str(path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads(path.read_text())
    assert out["scan_layers"] is False and out["layers"] == 2
    # Parameters of the narrowed config, counted by hand: embed + LM head (untied),
    # per layer qkv + o + gate_up + down + 2 norms, the final norm; float32.
    d, f, v, n, k, h = 512, 1792, 16032, 4, 1, 128
    per_layer = d * (n + 2 * k) * h + n * h * d + d * 2 * f + f * d + 2 * d
    assert out["weight_bytes"] == 4 * (2 * v * d + 2 * per_layer + d)
    assert set(out["steps"]) == {f"{b}/{m}" for b in (1, 4) for m in ("sync", "dispatch_ahead")}
    for step in out["steps"].values():
        assert math.isfinite(step["ms"]) and step["ms"] > 0
        assert math.isfinite(step["first_step_s"]) and step["first_step_s"] > 0
    assert out["recompiles"] == 0  # initialize compiled every executable the steps ran


def test_gpu_measure_script_writes_one_json(tmp_path, demo_model_dir):
    """scripts/gpu_measure.sh on the CPU, every section, tiny sizes, in one JSON.

    Kernel (interpret mode, the benchmark's CPU cases); decode narrowed (1
    layer, widths / 8, reference attention, batch 1); a 1-layer random model
    written with the demo tokenizer; LLM offline on 3 requests; the server at
    concurrency 1 and 2 over gRPC and HTTP. Structure and counts only.
    """
    model_dir = tmp_path / "model"
    cmd = [str(REPO / "scripts" / "gpu_measure.sh"), str(tmp_path), "--layers", "1",
           "--hidden-scale", "8", "--backend", "reference", "--dtype", "float32",
           "--decode-batch", "1", "--context", "64", "--decode-iters", "3",
           "--kernel-iters", "1", "--kernel-repeats", "1",
           "--tokenizer-dir", str(demo_model_dir), "--model-dir", str(model_dir),
           "--model-layers", "1", "--model-hidden", "128", "--model-intermediate", "256",
           "--model-heads", "2", "--model-kv-heads", "1", "--model-vocab", "256",
           "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--input-range", "8", "24",
           "--output-range", "3", "6", "--offline-requests", "3", "--concurrency", "1,2",
           "--serve-requests", "8", "--peak-gbps", "100",
           *[a for s in ("kernel", "decode", "model", "offline", "serve")
             for a in (f"--budget-{s}", "600")]]
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu",
               GPU_MEASURE_TIMEOUT="1500")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-5000:]
    out = json.loads((tmp_path / "gpu.json").read_text())
    assert (tmp_path / "gpu_measure.log").read_text()
    assert set(out["wall_s"]) == {"kernel", "decode", "model", "offline", "serve"}
    assert out["gpu"] is None and out["served_dtype"] == "float32"
    from benchmarks.kernels import bench_ragged_paged_attention as kernel_bench

    cases = out["kernel"]["cases"]
    assert [c["case"] for c in cases] == [c.name for c in kernel_bench.cpu_cases()]
    assert all(c["agrees"] and c["iters"] == 1 and c["trace_us"] is None for c in cases)
    assert list((tmp_path / "kernel_trace").rglob("*.trace.json.gz"))
    assert set(out["decode"]["steps"]) == {"1/sync", "1/dispatch_ahead"}
    assert out["decode"]["layers"] == 1 and out["decode"]["recompiles"] == 0
    summary = out["summary"]
    assert summary["kernel_pct_of_peak"] == {c["case"]: c["pct_of_peak"] for c in cases}
    assert summary["decode_ratio_to_weight_floor"] == {
        k: s["ratio_to_weight_floor"] for k, s in out["decode"]["steps"].items()}

    # The model: what PyTorch reads back, the tokenizer copied unchanged.
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    num_params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    assert model.config.num_hidden_layers == 1 and model.config.vocab_size == 256
    assert out["model"]["num_params"] == num_params
    assert out["model"]["decode_bytes"] == 4 * (num_params - embed)
    assert (model_dir / "tokenizer.json").read_bytes() == (
        demo_model_dir / "tokenizer.json").read_bytes()
    floor_ms = 1e3 * out["model"]["decode_bytes"] / 100e9
    assert summary["weight_floor_ms"] == pytest.approx(floor_ms)

    offline = out["offline"]
    assert offline["jaxserve"]["output_tokens"] == offline["workload"]["output_tokens"]
    assert offline["workload"]["num_requests"] == 3 and offline["jaxserve"]["compiles"] == 0
    assert summary["offline"]["output_tokens_per_s"] == offline["jaxserve"]["output_tokens_per_s"]

    assert out["serve"]["ready_seconds"] > 0 and (tmp_path / "serve_server.log").exists()
    for backend in ("grpc", "openai"):
        runs = out["serve"][backend]
        assert set(runs) == {"concurrency=1", "concurrency=2"}, runs
        for m in runs.values():
            assert m["failed"] == 0 and m["completed"] == m["num_requests"] == 8
        one = summary[f"serve_{backend}"]["concurrency=1"]
        assert one["tpot_p50_over_weight_floor"] == pytest.approx(
            runs["concurrency=1"]["tpot_ms"]["p50"] / floor_ms)


def test_gpu_measure_records_a_section_past_its_budget(tmp_path, demo_model_dir):
    """A section that runs past its budget is killed and recorded; those needing it are skipped."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_measure", "--json", str(tmp_path / "gpu.json"),
           "--skip", "kernel,decode", "--budget-model", "0.01",
           "--tokenizer-dir", str(demo_model_dir), "--model-dir", str(tmp_path / "model")]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "gpu.json").read_text())
    assert "timed out after its 0.01 s budget" in out["model"]["error"]
    for section in ("offline", "serve"):
        assert out[section]["error"].startswith("not run: the model section"), out[section]
    assert "kernel" not in out and "decode" not in out
    assert set(out["wall_s"]) == {"model", "offline", "serve"}


def test_cpu_side_by_side(tiny_model_dir, tmp_path):
    """Every workload kind through jaxserve, transformers and a stand-in vLLM in one run."""
    from tests.benchmarks.fake_vllm import fake_python

    out = run_bench("cpu_side_by_side", tmp_path, "--model", str(tiny_model_dir),
                    "--batch-sizes", "1", "3", "--prompt-lens", "7", "8", "--output-lens", "6", "4",
                    "--mix-requests", "3", "--mix-input-range", "8", "40", "--mix-output-range",
                    "4", "12", "--prefill-len", "40", "--bandwidth-mib", "64",
                    "--bandwidth-reps", "3", "--hf-max-batch", "1",
                    "--vllm-python", fake_python(tmp_path / "vllm"), *ENGINE)
    table, legs = out["table"], out["legs"]
    assert list(table) == ["batch1", "batch3", "mix", "prefill40"]
    runs = {"jaxserve": set(table), "transformers": {"batch1", "prefill40"},  # --hf-max-batch 1
            "vllm": set(table)}
    for engine, cases in runs.items():
        assert set(legs[engine]["workloads"]) == cases, engine
        for name, row in table.items():
            value = row[engine]
            assert (value is not None and math.isfinite(value) and value > 0) == (name in cases)
    for name, row in table.items():
        workload = out["workloads"][name]
        result = legs["jaxserve"]["workloads"][name]
        tokens = workload["prompt_tokens"] if name == "prefill40" else workload["output_tokens"]
        assert row["jaxserve"] == pytest.approx(tokens / result["elapsed"])
        assert result["compiles"] == 0
        assert row["jaxserve_over_vllm"] == pytest.approx(row["jaxserve"] / row["vllm"])
    assert table["batch1"]["jaxserve_over_transformers"] == pytest.approx(
        table["batch1"]["jaxserve"] / table["batch1"]["transformers"])
    assert table["mix"]["jaxserve_over_transformers"] is None
    assert "error" in legs["llama_cpp"] and table["batch1"]["llama_cpp"] is None
    roof = out["roofline"]
    assert roof["floor_tokens_per_s"] == pytest.approx(
        roof["bandwidth"]["best_gb_s"] * 1e9 / roof["weights"]["decode_bytes"])
    for engine in runs:
        assert roof["ratio"][engine] == pytest.approx(
            table["batch1"][engine] / roof["floor_tokens_per_s"])
    assert out["startup_seconds"]["jaxserve"] > 0 and out["startup_seconds"]["vllm"] >= 0
    assert all(v >= 0 for v in legs["jaxserve"]["load_cache"].values())
    assert len(out["load_average_before"]) == len(out["load_average_after"]) == 3


def test_structured_outputs(tiny_model_dir, tmp_path):
    """The three batches run, every constrained row is counted, no compile in the timed window;
    the matched batch generates exactly the half-constrained batch's tokens."""
    out = run_bench("structured_outputs", tmp_path, "--model", str(tiny_model_dir), "--batch", "4",
                    "--max-tokens", "8", "--repeats", "1", "--max-num-batched-tokens", "256")
    runs = out["runs"]
    assert set(runs) == {"unconstrained", "half_constrained", "unconstrained_matched"}
    assert (runs["unconstrained_matched"][0]["output_tokens"]
            == runs["half_constrained"][0]["output_tokens"])
    for name, (run,) in runs.items():
        assert run["compiles"] == 0, name
        assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["elapsed"])
    assert out["ratio"] == pytest.approx(out["output_tokens_per_s"]["half_constrained"]
                                         / out["output_tokens_per_s"]["unconstrained"])
    assert out["ratio_matched"] == pytest.approx(
        out["output_tokens_per_s"]["half_constrained"]
        / out["output_tokens_per_s"]["unconstrained_matched"])
    (counts,) = out["validation"]
    assert counts["constrained"] == 2  # rows 0 and 2 of 4
    assert counts["valid"] <= counts["parsed"] <= counts["constrained"]
    from benchmarks.structured_outputs import SCHEMAS

    for name in SCHEMAS:
        times = out["grammar_compile_s"][name]
        assert times["first"] > 0 and times["cached"] >= 0


def test_speculative(tiny_model_dir, tmp_path):
    """Every engine runs every workload; the speculative ones' outputs are the plain one's,
    their counters add up, and nothing compiles in the timed window."""
    out = run_bench("speculative", tmp_path, "--model", str(tiny_model_dir), "--max-tokens", "12",
                    "--repeats", "1", "--prompt-lookup-min", "1", "--workloads", "copy,noisy",
                    "--draft-model", "self")
    assert set(out["workloads"]) == {"copy", "noisy"}
    for name, row in out["workloads"].items():
        (plain,) = row["runs"]["plain"]
        assert plain["compiles"] == 0 and plain["drafts"] == 0 and plain["output_tokens"] > 0
        for method in ("ngram", "draft_model"):
            assert row["identical"][method], (name, method)
            (spec,) = row["runs"][method]
            assert spec["compiles"] == 0, (name, method)
            assert spec["output_tokens"] == plain["output_tokens"]
            assert spec["accepted_tokens"] <= spec["draft_tokens"]
            assert row["speedup"][method] == pytest.approx(
                row["output_tokens_per_s"][method] / row["output_tokens_per_s"]["plain"])
            if spec["drafts"]:
                assert row["mean_accepted_length"][method] == pytest.approx(
                    1 + spec["accepted_tokens"] / spec["drafts"])
        if name == "copy":  # greedy: the model drafting for itself is accepted
            (draft,) = row["runs"]["draft_model"]
            assert draft["accepted_tokens"] >= 0.9 * draft["draft_tokens"] > 0
