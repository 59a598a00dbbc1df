"""``jaxserve chat``: an interactive chat with a running server.

Reads one user message per line from stdin, streams each reply, and keeps
the conversation (rendered by the model's chat template on the server).
An empty line, ``/exit`` or end of input ends it; ``/reset`` forgets the
history. Sampling flags as ``jaxserve generate``.
"""

from __future__ import annotations

import argparse
import sys

from jaxserve.commands.generate import add_client_arguments, sampling_kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser)
    parser.add_argument("--system", default=None, help="a system message")


def run(args: argparse.Namespace) -> int:
    from jaxserve.client import Client, JaxServeError

    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    with Client(args.server, timeout=args.timeout) as client:
        while True:
            if interactive:
                sys.stdout.write("you> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            message = line.strip()
            if not line or not message or message == "/exit":
                return 0
            if message == "/reset":
                del history[1 if args.system else 0:]
                continue
            history.append({"role": "user", "content": message})
            sys.stdout.write("assistant> ")
            parts = []
            try:
                for delta in client.stream(messages=history, **sampling_kwargs(args)):
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                    parts.append(delta.text)
            except JaxServeError as err:
                print(f"\nerror: {err.code.name}: {err.message}", file=sys.stderr)
                history.pop()
                continue
            sys.stdout.write("\n")
            history.append({"role": "assistant", "content": "".join(parts)})
