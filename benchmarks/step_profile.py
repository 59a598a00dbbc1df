"""Where the time of each engine step goes: a profiled offline run of ``jaxserve.LLM``.

Run: ``jaxserve bench step_profile [--profile DIR] [--num-requests N]`` (or
``python -m benchmarks.step_profile``). (Not ``profile``: a module of that
name in a folder on ``sys.path`` would shadow the standard library's.)

A ShareGPT-like workload (smaller than ``offline_throughput``'s) runs once to
warm up and once inside ``jax.profiler.trace``; the trace is then read back
(``benchmarks.profiling``) and each step's time is split into attention,
matmuls (LM head included), the sampler, KV-cache writes, other device
work, idle time inside executables and host gaps (no executable running),
as milliseconds per step and as percentages of the window's wall time.
The same analysis runs on ``offline_throughput --profile DIR``.

Writes ``<results>/step_profile.json`` (every step) and the trace under DIR
(default ``<results>/step_profile_trace``; open it with XProf / TensorBoard, or
``*.trace.json.gz`` with Perfetto).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
from typing import Any

from benchmarks import common, offline_throughput
from benchmarks.jaxserve_leg import add_arguments as jaxserve_leg_arguments
from jaxserve.config import QUANTIZATION_METHODS

logger = logging.getLogger(__name__)

NAME = "step_profile"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    jaxserve_leg_arguments(parser)
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="trace folder (default <results>/step_profile_trace)")
    parser.add_argument("--num-requests", type=int, default=16, help="requests (default 16)")
    parser.add_argument("--input-range", type=int, nargs=2, default=(32, 512),
                        metavar=("MIN", "MAX"), help="prompt lengths (default 32 512)")
    parser.add_argument("--output-range", type=int, nargs=2, default=(32, 128),
                        metavar=("MIN", "MAX"), help="output lengths (default 32 128)")
    parser.add_argument("--input-len", type=int, default=None, help="fixed prompt length")
    parser.add_argument("--output-len", type=int, default=None, help="fixed output length")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                        help="weight quantization (default: float weights; docs/model.md)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks import profiling

    profiling.prepare_process()
    from benchmarks import jaxserve_leg

    trace_dir = args.profile or str(pathlib.Path(args.results) / f"{NAME}_trace")
    model_dir = str(common.resolve_model(args.model))
    workload = offline_throughput.make_workload(args, offline_throughput.vocab_size(model_dir))
    options = jaxserve_leg.EngineOptions(max_num_seqs=args.max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         attention_backend=args.attention_backend,
                                         quantization=args.quantization)
    leg = jaxserve_leg.run(workload, model=model_dir, tokenizer=args.tokenizer, options=options,
                           seed=args.seed, profile_dir=trace_dir)
    return {"benchmark": NAME, "args": vars(args), "environment": common.environment(),
            "workload": workload.summary(), "engine_options": options.as_dict(),
            "jaxserve": {k: v for k, v in leg.items() if k != "profile"},
            "profile": leg["profile"]}


def main(argv: list[str] | None = None) -> int:
    args, result, path = common.run_cli(NAME, __doc__, add_arguments, run, argv)
    from benchmarks import profiling

    leg = result["jaxserve"]
    print(f"jaxserve: {leg['output_tokens_per_s']:.1f} output tok/s over {leg['elapsed']:.1f} s "
          f"(profiler on; load average {result['environment']['load_average']})")
    print(profiling.format_report(result["profile"]))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
