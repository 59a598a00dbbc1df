"""``jaxserve chat``: an interactive chat with a running server.

Reads one user message per line from stdin, streams each reply, and keeps
the conversation (rendered by the model's chat template on the server).
An empty line, ``/exit`` or end of input ends it; ``/reset`` forgets the
history. Sampling flags as ``jaxserve generate``, except that a reply is at
most ``--max-tokens`` 512 tokens unless told otherwise (a chat should not run
to the end of the context); invalid flags are refused before the first
message (exit status 2). Exit status 1 when any reply
failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys

from jaxserve.commands.generate import (add_client_arguments, client_kwargs, error_message,
                                        sampling_kwargs)

DEFAULT_MAX_TOKENS = 512  # most tokens in one reply unless --max-tokens says otherwise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_client_arguments(parser, default_max_tokens=DEFAULT_MAX_TOKENS)
    parser.add_argument("--system", default=None, help="a system message")


def run(args: argparse.Namespace) -> int:
    from jaxserve.client import Client, JaxServeError
    from jaxserve.sampling_params import SamplingParams

    try:
        SamplingParams(**sampling_kwargs(args))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    failed = False
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    with Client(args.server, **client_kwargs(args)) as client:
        while True:
            if interactive:
                sys.stdout.write("you> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            message = line.strip()
            if not line or not message or message == "/exit":
                return 1 if failed else 0
            if message == "/reset":
                del history[1 if args.system else 0:]
                continue
            history.append({"role": "user", "content": message})
            parts = []
            last = None
            try:
                for delta in client.stream(messages=history, **sampling_kwargs(args)):
                    if not parts:
                        sys.stdout.write("assistant> ")
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                    parts.append(delta.text)
                    last = delta
            except JaxServeError as err:
                if parts:
                    sys.stdout.write("\n")
                print(error_message(err, args.server), file=sys.stderr)
                failed = True
                history.pop()
                continue
            sys.stdout.write("\n")
            if last is not None and last.finish_reason == "length":
                print(f"[the reply was cut at {last.usage.completion_tokens} tokens; "
                      f"--max-tokens sets the limit]", file=sys.stderr)
            history.append({"role": "assistant", "content": "".join(parts)})
