"""``jaxserve bench <name> [options]``: run one of the benchmarks in ``benchmarks/``.

The options after the name are the benchmark's own (``jaxserve bench <name> --help``);
``jaxserve bench <name>`` is the same as ``python -m benchmarks.<name>``. See
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib

# Kept in step with benchmarks.BENCHMARKS (a test checks); listed here so that
# ``jaxserve --help`` does not import the benchmarks package.
NAMES = ("offline_throughput", "serving", "step_profile", "decode_roofline", "cpu_side_by_side",
         "structured_outputs", "speculative")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=NAMES, help="the benchmark")
    parser.add_argument("options", nargs=argparse.REMAINDER,
                        help="the benchmark's options (see jaxserve bench NAME --help)")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"benchmarks.{args.name}")
    return int(module.main(list(args.options)) or 0)
