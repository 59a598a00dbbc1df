"""``jaxserve generate "prompt"``: stream one completion from a running server to stdout.

    jaxserve generate "The capital of France is" --max-tokens 16 --temperature 0
    jaxserve generate --server host:50051 "Once upon a time" --stop "." --seed 7

Sampling flags map to ``SamplingParams`` fields; unset ones take the
server's defaults (the model's ``generation_config.json``, else
``SamplingParams``'; ``max_tokens``: up to the context length). The finish
reason and token counts go to stderr. Exit status 1 on a server error (its
status and message are printed; when no server answers, how to start one).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from jaxserve.client.sync import DEFAULT_TARGET
from jaxserve.launcher import API_KEY_ENV

_SAMPLING_FLAGS = (("max_tokens", int), ("temperature", float), ("top_p", float),
                   ("top_k", int), ("min_p", float), ("seed", int),
                   ("repetition_penalty", float), ("presence_penalty", float),
                   ("frequency_penalty", float))


def add_client_arguments(parser: argparse.ArgumentParser,
                         default_max_tokens: int | None = None) -> None:
    """``--server``, ``--timeout`` and the sampling flags (shared with ``chat``).

    Unset sampling flags are not sent (the server's defaults apply), except
    ``--max-tokens`` when ``default_max_tokens`` is given.
    """
    parser.add_argument("--server", default=DEFAULT_TARGET,
                        help=f"host[:port] of a running server (default {DEFAULT_TARGET}; "
                             f"the port defaults to 50051)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per request")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"the server's API key (default ${API_KEY_ENV})")
    parser.add_argument("--tls", action="store_true",
                        help="connect with TLS, trusting the system's root certificates")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="connect with TLS, trusting this certificate file (e.g. the "
                             "server's self-signed --ssl-certfile)")
    for name, kind in _SAMPLING_FLAGS:
        default = default_max_tokens if name == "max_tokens" else None
        shown = "the server's" if default is None else default
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                            help=f"SamplingParams.{name} (default: {shown})")
    parser.add_argument("--stop", action="append", default=None,
                        help="a stop string (repeatable)")


def client_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``Client`` keyword arguments from the connection flags (``--timeout``, key, TLS)."""
    roots = None
    if args.tls_ca:
        try:
            with open(args.tls_ca, "rb") as f:
                roots = f.read()
        except OSError as err:
            raise SystemExit(f"error: --tls-ca {args.tls_ca}: {err.strerror}") from None
        if b"-----BEGIN CERTIFICATE-----" not in roots:
            raise SystemExit(f"error: --tls-ca {args.tls_ca}: not a PEM certificate")
    return dict(timeout=args.timeout, api_key=args.api_key, tls=args.tls,
                root_certificates=roots)


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags that were given."""
    out = {name: getattr(args, name) for name, _ in _SAMPLING_FLAGS
           if getattr(args, name) is not None}
    if args.stop:
        out["stop"] = list(args.stop)
    return out


def error_message(err: Any, server: str) -> str:
    """The one line a client command prints for a failed call (``err``: a ``JaxServeError``).

    When nothing answers at ``server``, it says how to start a server.
    """
    line = f"error: {err.code.name}: {err.message}"
    message = err.message.lower()
    if err.code.name != "UNAVAILABLE":
        return line
    if "http1.x" in message or "http/1" in message or "parsing http/2" in message:
        return line + (f"\n{server} answers HTTP/1.1, not gRPC: is it the HTTP (OpenAI API) "
                       f"port? jaxserve's gRPC port is 50051 unless --port says otherwise")
    if "certificate_verify_failed" in message or "certificate verify failed" in message:
        return line + ("\nthe server's TLS certificate is not trusted: pass it with "
                       "--tls-ca CERT.pem (a self-signed --ssl-certfile)")
    if "socket closed" in message or "ssl" in message or "handshake" in message:
        return line + ("\nthe connection was closed during set-up: if the server uses TLS "
                       "(--ssl-certfile), pass --tls or --tls-ca CERT.pem")
    if "failed to connect" in message:
        line += (f"\nno jaxserve server answers at {server}; start one with "
                 f"`jaxserve serve --model MODEL_DIR` (or `jaxserve serve` for the demo model), "
                 f"or pass --server HOST:PORT")
    return line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from jaxserve.client import Client, JaxServeError

    last = None
    try:
        with Client(args.server, **client_kwargs(args)) as client:
            for delta in client.stream(args.prompt, **sampling_kwargs(args)):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                last = delta
    except JaxServeError as err:
        print("\n" + error_message(err, args.server), file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    if last is not None and last.usage is not None:
        print(f"[finish reason {last.finish_reason}, {last.usage.prompt_tokens} prompt tokens, "
              f"{last.usage.completion_tokens} generated]", file=sys.stderr)
    return 0
