"""The vLLM leg's plumbing (runner script, subprocess, JSON) with a stand-in ``vllm`` package.

``tests.benchmarks.fake_vllm`` stands in for vLLM: the real ``vllm_runner.py``
runs in a subprocess through a wrapper interpreter, as ``--vllm-python`` would.
"""

from __future__ import annotations

import importlib.util
import sys

from benchmarks import vllm_leg
from benchmarks.dataset import fixed_lengths, sharegpt_like
from tests.benchmarks.fake_vllm import fake_python


def test_runner_round_trip(tmp_path):
    workload = sharegpt_like(5, 1000, seed=1, input_range=(4, 20), output_range=(2, 9))
    result = vllm_leg.run(workload, model_dir=str(tmp_path), python=fake_python(tmp_path),
                          max_num_seqs=4, max_num_batched_tokens=64)
    assert "error" not in result, result.get("error")
    assert result["output_tokens"] == workload.num_output_tokens
    assert result["vllm"] == "0.0-fake"
    assert result["output_tokens_per_s"] == workload.num_output_tokens / result["elapsed"]


def test_short_outputs_and_crashes_are_reported(tmp_path):
    workload = fixed_lengths(3, 1000, 5, 4)
    short = vllm_leg.run(workload, model_dir=str(tmp_path), python=fake_python(tmp_path, True),
                         max_num_seqs=4, max_num_batched_tokens=64)
    assert "expected 12" in short["error"]
    if importlib.util.find_spec("vllm") is None:  # then the runner dies importing it
        crashed = vllm_leg.run(workload, model_dir=str(tmp_path), python=sys.executable,
                               max_num_seqs=4, max_num_batched_tokens=64)
        assert "exited with 1" in crashed["error"] and "vllm" in crashed["error"]


def test_one_runner_runs_every_workload(tmp_path):
    workloads = {"a": fixed_lengths(1, 1000, 7, 5), "b": fixed_lengths(3, 1000, 4, 2, seed=2)}
    result = vllm_leg.run_workloads(workloads, model_dir=str(tmp_path),
                                    python=fake_python(tmp_path), max_num_seqs=4,
                                    max_num_batched_tokens=64, memory_fraction=0.3)
    assert "error" not in result, result.get("error")
    assert result["memory_fraction"] == 0.3 and result["load_seconds"] >= 0
    assert list(result["workloads"]) == ["a", "b"]
    for name, workload in workloads.items():
        leg = result["workloads"][name]
        assert leg["output_tokens"] == workload.num_output_tokens
        assert leg["output_tokens_per_s"] == workload.num_output_tokens / leg["elapsed"]
