"""``jaxserve serve``: run the server (worker, engine and api processes) until SIGINT / SIGTERM.

Logs go to stderr. Exit status 0 after a signal; 1 when a server process
exits on its own (it is logged, and the others are stopped).
"""

from __future__ import annotations

import argparse
import logging

from jaxserve.engine.service import add_engine_arguments, engine_flags
from jaxserve.generation_config import AUTO, generation_config_source

logger = logging.getLogger(__name__)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``serve`` and ``demo`` share (engine flags included)."""
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the gRPC server listens on (default 127.0.0.1)")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="sequences that may wait beyond --max-num-seqs before new requests "
                             "get RESOURCE_EXHAUSTED (default 256)")
    parser.add_argument("--ready-timeout", type=float, default=None,
                        help="seconds to wait for the server to start (default: no limit)")
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
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051)")
    parser.add_argument("--metrics-port", type=int, default=9090,
                        help="Prometheus /metrics HTTP port (default 9090; 0 = off)")


def serve_options(args: argparse.Namespace, **overrides: object):
    """``ServeOptions`` from parsed ``add_server_arguments`` flags (plus ``overrides``)."""
    from jaxserve.launcher import ServeOptions

    values = dict(model=args.model, host=args.host, port=getattr(args, "port", 50051),
                  metrics_port=getattr(args, "metrics_port", 0),
                  max_waiting_requests=args.max_waiting_requests,
                  engine_flags=tuple(engine_flags(args)), log_level=args.log_level,
                  in_process_worker=args.in_process_worker,
                  generation_config=args.generation_config)
    values.update(overrides)
    return ServeOptions(**values)


def run(args: argparse.Namespace) -> int:
    from jaxserve.demo_model import DemoModelError
    from jaxserve.launcher import Launcher, ServerExited
    from jaxserve.procutil import StopSignal

    stop = StopSignal()
    launcher = Launcher(serve_options(args))
    try:
        try:
            launcher.start()
        except (FileNotFoundError, ValueError, DemoModelError) as err:
            logger.error("%s", err)
            return 1
        seconds = launcher.wait_ready(args.ready_timeout, stop_event=stop.event)
        logger.info("jaxserve ready on %s after %.1f s", launcher.address, seconds)
        return launcher.wait(stop.event)
    except InterruptedError:
        return 0
    except (ServerExited, TimeoutError) as err:
        logger.error("%s", err)
        return 1
    finally:
        launcher.shutdown()
