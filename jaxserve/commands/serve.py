"""``jaxserve serve``: run the server (worker, engine and api processes) until SIGINT / SIGTERM.

The api process serves the gRPC ``jaxserve.GenerateService`` on ``--port``
(default 50051) and the OpenAI-compatible HTTP API on ``--http-port``
(default 8000; ``--no-http``: gRPC only), both on ``--host``.

``--data-parallel-size D`` runs D engine + worker replicas behind the one api
process (``jaxserve.launcher``).

Logs go to stderr. Exit status 0 after a signal; 1 when a server process
exits on its own (it is logged, and the others are stopped).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from jaxserve.engine.service import (add_engine_arguments, engine_config, engine_flags,
                                     positive_int)
from jaxserve.api.tool_parsers import add_tool_arguments, check_tool_arguments
from jaxserve.launcher import API_KEY_ENV
from jaxserve.generation_config import AUTO, generation_config_source

logger = logging.getLogger(__name__)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``serve`` and ``demo`` share (engine flags included)."""
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address every port of the server listens on (default "
                             "127.0.0.1)")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="sequences that may wait beyond --max-num-seqs (times the "
                             "data-parallel replicas) before new requests get "
                             "RESOURCE_EXHAUSTED (default 256)")
    parser.add_argument("--ready-timeout", type=float, default=None,
                        help="seconds to wait for the server to start (default: no limit)")
    parser.add_argument("--shutdown-grace", type=float, default=30.0,
                        help="on SIGINT / SIGTERM, seconds running requests get to finish "
                             "before they are aborted (default 30; a second signal aborts "
                             "at once)")
    parser.add_argument("--in-process-worker", action="store_true",
                        help="run the model inside the engine process (development)")
    parser.add_argument("--generation-config", type=generation_config_source, default=AUTO,
                        help="default sampling parameters for fields a request leaves unset: "
                             "auto = the model's generation_config.json (temperature, top_p, "
                             "top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), "
                             "vllm = SamplingParams' own defaults, or a directory holding a "
                             "generation_config.json (default auto)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                        metavar="D",
                        help="run D independent engine + worker replicas behind the one api "
                             "process; each request goes to the replica with the fewest "
                             "requests in flight (default 1; every replica gets the engine "
                             "flags above and its own KV cache)")
    parser.add_argument("--num-worker-hosts", type=positive_int, default=1, metavar="H",
                        help="start H local worker processes per replica, joined as one "
                             "multi-host worker (jax.distributed): multi-host on one machine, "
                             "for testing; -tp then counts every process's devices (default 1; "
                             "docs/scale_out.md)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051)")
    parser.add_argument("--http-port", type=int, default=8000,
                        help="OpenAI-compatible HTTP API port (default 8000)")
    parser.add_argument("--no-http", dest="http_port", action="store_const", const=0,
                        help="serve gRPC only (no HTTP API)")
    parser.add_argument("--metrics-port", type=int, default=9090,
                        help="Prometheus /metrics HTTP port (default 9090; 0 = off)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in both APIs (the OpenAI `model` field; default: "
                             "the model folder's name)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require this key on both APIs (HTTP `Authorization: Bearer KEY`, "
                             f"gRPC metadata `authorization: Bearer KEY`; default "
                             f"${API_KEY_ENV})")
    parser.add_argument("--ssl-certfile", default=None,
                        help="TLS certificate (PEM) for both APIs; needs --ssl-keyfile")
    parser.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    add_tool_arguments(parser)


def serve_options(args: argparse.Namespace, **overrides: object):
    """``ServeOptions`` from parsed ``add_server_arguments`` flags (plus ``overrides``)."""
    from jaxserve.launcher import ServeOptions

    values = dict(model=args.model, host=args.host, port=getattr(args, "port", 50051),
                  metrics_port=getattr(args, "metrics_port", 0),
                  http_port=getattr(args, "http_port", 0),
                  served_model_name=getattr(args, "served_model_name", None),
                  api_key=getattr(args, "api_key", None),
                  ssl_certfile=getattr(args, "ssl_certfile", None),
                  ssl_keyfile=getattr(args, "ssl_keyfile", None),
                  tool_call_parser=(args.tool_call_parser
                                    if getattr(args, "enable_auto_tool_choice", False) else None),
                  max_waiting_requests=args.max_waiting_requests,
                  shutdown_grace=args.shutdown_grace,
                  engine_flags=tuple(engine_flags(args)), log_level=args.log_level,
                  in_process_worker=args.in_process_worker,
                  generation_config=args.generation_config,
                  data_parallel_size=getattr(args, "data_parallel_size", 1),
                  num_worker_hosts=getattr(args, "num_worker_hosts", 1))
    values.update(overrides)
    return ServeOptions(**values)


def run(args: argparse.Namespace) -> int:
    from jaxserve.demo_model import DemoModelError
    from jaxserve.launcher import Launcher, ServerExited
    from jaxserve.procutil import StopSignal, keep_torch_out

    keep_torch_out()  # this process only launches: before transformers reads the model's files
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        logger.error("--ssl-certfile and --ssl-keyfile go together")
        return 2
    try:
        check_tool_arguments(args)
    except ValueError as err:
        logger.error("%s", err)
        return 2
    try:
        engine_config(args)  # the engine's own checks (ladders, limits), before any process
    except ValueError as err:
        logger.error("%s", err)
        return 2
    stop = StopSignal()
    launcher = Launcher(serve_options(args))
    started = time.monotonic()  # start() itself waits for the workers' addresses
    try:
        try:
            launcher.start()
        except (FileNotFoundError, ValueError, DemoModelError) as err:
            logger.error("%s", err)
            return 1
        launcher.wait_ready(args.ready_timeout, stop_event=stop.event)
        logger.info("jaxserve ready on %s (gRPC)%s after %.1f s", launcher.address,
                    f" and port {args.http_port} (HTTP)" if args.http_port else "",
                    time.monotonic() - started)
        return launcher.wait(stop.event)
    except InterruptedError:
        return 0
    except (ServerExited, TimeoutError) as err:
        logger.error("%s", err)
        return 1
    finally:
        launcher.shutdown(abort=stop.again)
