"""Offline throughput: ``jaxserve.LLM`` against transformers (and vLLM) on the same prompts.

Run: ``jaxserve bench offline_throughput [--num-requests N] [--vllm-python PATH]
[--profile DIR]`` (or ``python -m benchmarks.offline_throughput``).

The defaults (16 requests, prompts 32–512, outputs 32–128 tokens) fit the
10-minute budget on the 2-core CPU, where transformers' leg is the slow
one; ``--input-range 32 1024 --output-range 32 512`` is the full mix.

N requests with ShareGPT-like lengths from a fixed seed (``benchmarks.dataset``;
``--input-len`` / ``--output-len`` fix them instead) go through each engine,
greedy, float32 (``--dtype``), every request generating exactly its output
length. Each leg loads its engine, warms up, then times the generation
alone. Reported:
output tokens/s of each engine and jaxserve's ratio to each (> 1: jaxserve
is faster). The transformers leg batches statically (``benchmarks.hf_leg``
says how); the vLLM leg runs in vLLM's own venv (``benchmarks.vllm_leg``).
``--profile DIR`` profiles jaxserve's timed run and prints where the time
of each step went (``benchmarks.profiling``).

Writes ``<results>/offline_throughput.json`` and ``offline_throughput.png``.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
from typing import Any

from benchmarks import common, vllm_leg
from benchmarks.jaxserve_leg import add_arguments as jaxserve_leg_arguments
from benchmarks.dataset import Workload, fixed_lengths, sharegpt_like

logger = logging.getLogger(__name__)

NAME = "offline_throughput"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    jaxserve_leg_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=16, help="requests (default 16)")
    parser.add_argument("--input-range", type=int, nargs=2, default=(32, 512),
                        metavar=("MIN", "MAX"),
                        help="prompt lengths (default 32 512; the full ShareGPT-like mix: 32 1024)")
    parser.add_argument("--output-range", type=int, nargs=2, default=(32, 128),
                        metavar=("MIN", "MAX"),
                        help="output lengths (default 32 128; the full mix: 32 512)")
    parser.add_argument("--input-len", type=int, default=None,
                        help="fixed prompt length (with --output-len; overrides the ranges)")
    parser.add_argument("--output-len", type=int, default=None, help="fixed output length")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="parameter dtype of every leg (default float32)")
    parser.add_argument("--hf-batch-size", type=int, default=16,
                        help="transformers' static batch size (default 16)")
    parser.add_argument("--hf-device", default="cpu", help="torch device of transformers' leg")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers leg")
    vllm_leg.add_arguments(parser)
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="profile jaxserve's timed run into DIR and print the step breakdown")


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    if (args.input_len is None) != (args.output_len is None):
        raise SystemExit("--input-len and --output-len go together")
    if args.input_len is not None:
        return fixed_lengths(args.num_requests, vocab_size, args.input_len, args.output_len,
                             seed=args.seed)
    return sharegpt_like(args.num_requests, vocab_size, seed=args.seed,
                         input_range=tuple(args.input_range), output_range=tuple(args.output_range))


def vocab_size(model_dir: str) -> int:
    """V from the model directory's config.json."""
    import json
    import pathlib

    return int(json.loads(pathlib.Path(model_dir, "config.json").read_text())["vocab_size"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.profile:
        from benchmarks import profiling

        profiling.prepare_process()
    else:
        common.use_compilation_cache()  # before jax starts its backend
    from benchmarks import jaxserve_leg

    model_dir = str(common.resolve_model(args.model))
    workload = make_workload(args, vocab_size(model_dir))
    logger.info("workload: %s", workload.summary())
    options = jaxserve_leg.EngineOptions(max_num_seqs=args.max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         dtype=args.dtype, attention_backend=args.attention_backend)
    load_before = common.load_average()
    legs: dict[str, Any] = {"jaxserve": jaxserve_leg.run(
        workload, model=model_dir, tokenizer=args.tokenizer, options=options, seed=args.seed,
        profile_dir=args.profile)}
    if not args.skip_hf:
        from benchmarks import hf_leg

        legs["transformers"] = hf_leg.run(workload, model_dir=model_dir,
                                          batch_size=args.hf_batch_size, dtype=args.dtype,
                                          device=args.hf_device)
    python = vllm_leg.find_python(args.vllm_python)
    if python is None:
        legs["vllm"] = {"error": "vllm is not importable here and no --vllm-python was given"}
    else:
        legs["vllm"] = vllm_leg.run(workload, model_dir=model_dir, python=python,
                                    max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    dtype=args.dtype,
                                    memory_fraction=args.vllm_memory_fraction)
    jax_tps = legs["jaxserve"]["output_tokens_per_s"]
    ratios = {f"jaxserve_over_{name}": jax_tps / leg["output_tokens_per_s"]
              for name, leg in legs.items() if name != "jaxserve" and "error" not in leg}
    return {"benchmark": NAME, "args": vars(args), "environment": common.environment(),
            "load_average_before": load_before, "workload": workload.summary(),
            "engine_options": options.as_dict(),
            "legs": legs, "ratios": ratios}


def report(result: dict[str, Any]) -> str:
    """The human-readable summary printed at the end."""
    w = result["workload"]
    lines = [f"offline throughput: {w['num_requests']} requests, {w['prompt_tokens']} prompt + "
             f"{w['output_tokens']} output tokens (load average "
             f"{result['environment']['load_average']})"]
    for name, leg in result["legs"].items():
        if "error" in leg:
            lines.append(f"  {name:13s} not run: {leg['error']}")
            continue
        extra = ""
        if "compiles" in leg and leg["compiles"]:
            extra = f"  ({leg['compiles']} compiles, {leg['compile_seconds']:.1f} s, in the window)"
        lines.append(f"  {name:13s} {leg['output_tokens_per_s']:8.1f} output tok/s  "
                     f"{leg['elapsed']:7.1f} s{extra}")
    for name, ratio in result["ratios"].items():
        lines.append(f"  {name}: {ratio:.2f}x")
    if "profile" in result["legs"]["jaxserve"]:
        from benchmarks import profiling

        lines.append(profiling.format_report(result["legs"]["jaxserve"]["profile"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, result, path = common.run_cli(NAME, __doc__, add_arguments, run, argv)
    from benchmarks import plots

    png = plots.bars({name: leg["output_tokens_per_s"] for name, leg in result["legs"].items()
                      if "error" not in leg},
                     pathlib.Path(args.results) / f"{NAME}.png",
                     f"offline throughput, {result['workload']['num_requests']} requests",
                     "output tokens / s")
    print(report(result))
    print(f"results: {path}" + (f"\nplot: {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
