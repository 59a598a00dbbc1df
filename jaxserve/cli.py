"""The ``jaxserve`` command line.

Each subcommand lives in its own module, which exposes
``add_arguments(parser)`` and ``run(args) -> int``; those modules keep heavy
imports (jax, torch, grpc) inside ``run`` so that ``jaxserve --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "download-demo": ("jaxserve.demo_model", "build the SmolLM2-135M-Instruct demo model directory"),
    "serve": ("jaxserve.commands.serve",
              "serve a model over gRPC (the jaxserve.GenerateService, --port) and the "
              "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions; --http-port, "
              "--no-http) from worker, engine and api processes"),
    "demo": ("jaxserve.commands.demo",
             "serve the demo model, stream one chat answer through the client, shut down"),
    "generate": ("jaxserve.commands.generate", "stream a completion from a running server"),
    "chat": ("jaxserve.commands.chat", "chat with a running server"),
    "save-checkpoint": ("jaxserve.commands.save_checkpoint",
                        "convert a model once into an Orbax parameter checkpoint directory"),
    "bench": ("jaxserve.bench", "run a benchmark (offline_throughput, serving, step_profile, ...)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text,
                                    allow_abbrev=False)
        mod = importlib.import_module(module)
        mod.add_arguments(sub_parser)
        sub_parser.set_defaults(_module=mod, _parser=sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # a misspelt flag: the subcommand's usage, not the top-level one (exits 2)
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from jaxserve.procutil import quiet_library_notices

    quiet_library_notices()
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C in a client command: the stream is cancelled
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
