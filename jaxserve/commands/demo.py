"""``jaxserve demo``: serve the demo model, stream one chat answer through the client, shut down.

The README's first command (``pip install -e . && jaxserve demo``). The demo
model (SmolLM2-135M-Instruct) is built on first use. The answer goes to
stdout, the servers' logs and the timings to stderr. Small engine limits
keep the start-up compiles short: 1 sequence, 64-token steps, and a T ladder
of two rungs — 1 (every decode step of the one sequence) and the token budget
(the prompt, padded) — so two model bodies instead of six.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from jaxserve.commands.serve import add_server_arguments

logger = logging.getLogger(__name__)

DEFAULT_QUESTION = "What is the capital of France? Answer in one sentence."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.set_defaults(max_num_seqs=1, max_num_batched_tokens=64)
    parser.add_argument("--port", type=int, default=0, help="gRPC port (default: a free one)")
    parser.add_argument("--question", default=DEFAULT_QUESTION, help="the user message to send")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens in the answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")


def demo_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """The demo's T ladder: 1 and the token budget (one rung when the budget is 1)."""
    return tuple(sorted({1, max_num_batched_tokens}))


def run(args: argparse.Namespace) -> int:
    from jaxserve.client import Client, JaxServeError
    from jaxserve.commands.serve import serve_options
    from jaxserve.demo_model import DemoModelError
    from jaxserve.launcher import Launcher, ServerExited
    from jaxserve.procutil import StopSignal, free_port, keep_torch_out

    keep_torch_out()  # this process only launches: before transformers reads the model's files
    if not args.token_buckets:
        args.token_buckets = demo_token_buckets(args.max_num_batched_tokens)
    stop = StopSignal()
    start = time.monotonic()
    launcher = Launcher(serve_options(args, port=args.port or free_port(args.host),
                                      metrics_port=0))
    try:
        launcher.start()
        launcher.wait_ready(args.ready_timeout, stop_event=stop.event)
        logger.info("server ready after %.1f s (start-up: launch, load, compile); asking: %s",
                    time.monotonic() - start, args.question)
        sys.stdout.write(f"user: {args.question}\nassistant: ")
        sys.stdout.flush()
        t0 = time.monotonic()
        last = None
        with Client(launcher.address, timeout=300) as client:
            for delta in client.stream(messages=[{"role": "user", "content": args.question}],
                                       max_tokens=args.max_tokens,
                                       temperature=args.temperature):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                last = delta
        sys.stdout.write("\n")
        if last is not None and last.usage is not None:
            logger.info("%d tokens in %.2f s (finish reason %s)",
                        last.usage.completion_tokens, time.monotonic() - t0,
                        last.finish_reason)
        return 0
    except InterruptedError:
        return 130
    except (ServerExited, TimeoutError, JaxServeError, FileNotFoundError, ValueError,
            DemoModelError) as err:
        logger.error("demo failed: %s", err)
        return 1
    finally:
        launcher.shutdown()
