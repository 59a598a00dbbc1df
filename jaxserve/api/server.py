"""The api process: the public gRPC server (``jaxserve.GenerateService``, health, reflection).

    python -m jaxserve.api.server --engine-address 127.0.0.1:50061 --model DIR \\
        [--host 0.0.0.0] [--port 50051] [--metrics-port 9090]

Started by ``jaxserve serve`` (``jaxserve.launcher``). Start-up: bind the port
at once (health NOT_SERVING), load the tokenizer, wait for the engine process
(``EngineClient.connect``: it is ready once its worker has loaded and compiled
the model), then report SERVING for "" and "jaxserve.GenerateService". Server
reflection lists GenerateService and Health. Prometheus metrics
(``jaxserve.metrics``) are served over HTTP on ``--metrics-port`` (0 = off).

NOT_SERVING again when the engine fails or is lost (its requests fail with
``UNAVAILABLE``); SERVING again once the engine serves again (on a new
worker: ``EngineClient`` reopens its output stream). SIGINT / SIGTERM: health NOT_SERVING, running requests end
with finish reason "abort", the server stops after a short grace period.
Never imports jax.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import signal
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.api.engine_client import EngineClient, EngineError
from jaxserve.api.generate_service import SERVICE_NAME, GenerateServicer, stats_refresher
from jaxserve.api.prompts import RequestPreparer
from jaxserve.metrics import ServerMetrics
from jaxserve.procutil import setup_logging
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto import generate_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DEFAULT_MAX_WAITING_REQUESTS = 256


def load_tokenizer(path: str):
    """The model's Hugging Face tokenizer (as ``jaxserve.LLM`` loads it)."""
    from transformers import AutoTokenizer  # heavy import, kept local

    return AutoTokenizer.from_pretrained(path)


class ApiServer:
    """The api process's server; ``await run()`` serves until ``stop()``.

    Args:
      args: parsed flags (see ``main``).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engine = EngineClient(args.engine_address)
        self.metrics = ServerMetrics(
            lambda: self.engine.latest_stats,
            lambda: self.servicer.num_pending_seqs if self.servicer is not None else 0)
        self.health = health.aio.HealthServicer()
        self.servicer: GenerateServicer | None = None
        self._stopped = asyncio.Event()

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def stop(self) -> None:
        self._stopped.set()

    async def run(self) -> None:
        args = self.args
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        await self._set_health(NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["GenerateService"].full_name,
             health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{args.host}:{args.port}"
        if server.add_insecure_port(address) == 0:
            raise RuntimeError(f"cannot bind {address}")
        if args.metrics_port:  # bound now, so a busy port fails before the slow start-up
            try:
                self.metrics.serve(args.metrics_port, args.host)
            except OSError as err:
                raise RuntimeError(f"--metrics-port {args.metrics_port}: cannot listen on "
                                   f"{args.host}:{args.metrics_port}: {err.strerror}") from None
            logger.info("metrics on http://%s:%d/metrics", args.host, args.metrics_port)
        tokenizer = await asyncio.to_thread(load_tokenizer, args.model)
        # Generate must exist before start (aio servers take no handlers later): it
        # answers UNAVAILABLE until the engine is connected.
        info_future: asyncio.Future = asyncio.get_running_loop().create_future()
        pb_grpc.add_GenerateServiceServicer_to_server(_Deferred(info_future), server)
        await server.start()
        logger.info("api listening on %s; waiting for the engine at %s", address,
                    args.engine_address)
        connect = asyncio.create_task(self.engine.connect(timeout=args.engine_timeout))
        stopped = asyncio.create_task(self._stopped.wait())
        await asyncio.wait({connect, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not connect.done():  # stopped while waiting for the engine
            connect.cancel()
            await server.stop(grace=0)
            await self.engine.close()
            return
        stopped.cancel()
        info = connect.result()  # raises EngineError when the engine never answered
        preparer = RequestPreparer(tokenizer, vocab_size=info.vocab_size,
                                   max_model_len=info.max_model_len,
                                   eos_token_ids=info.eos_token_ids,
                                   max_num_seqs=info.max_num_seqs)
        self.servicer = GenerateServicer(
            self.engine, preparer, model_name=args.served_model_name or _model_name(args.model),
            metrics=self.metrics,
            max_pending_seqs=info.max_num_seqs + args.max_waiting_requests)
        info_future.set_result(self.servicer)
        loop = asyncio.get_running_loop()
        self.engine.on_failure(
            lambda error: loop.create_task(self._set_health(NOT_SERVING)))
        self.engine.on_recovery(lambda: loop.create_task(self._set_health(SERVING)))
        refresh = asyncio.create_task(stats_refresher(self.engine)())
        await self._set_health(SERVING)
        logger.info("api serving %s on %s (max_model_len %d, %d usable KV blocks of %d tokens)",
                    self.servicer.model_name, address, info.max_model_len,
                    info.num_kv_blocks - 1, info.block_size)
        await self._stopped.wait()
        logger.info("api shutting down")
        await self._set_health(NOT_SERVING)
        self.servicer.begin_shutdown()
        refresh.cancel()
        await server.stop(grace=args.shutdown_grace)
        await self.engine.close()
        logger.info("api stopped")


class _Deferred(pb_grpc.GenerateServiceServicer):
    """Forwards to the ``GenerateServicer`` once it exists; UNAVAILABLE before."""

    def __init__(self, servicer: asyncio.Future) -> None:
        self._servicer = servicer

    async def _target(self, context: grpc.aio.ServicerContext) -> GenerateServicer:
        if not self._servicer.done():
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the server is starting: the engine is not ready yet")
        return self._servicer.result()

    async def Generate(self, request, context):
        servicer = await self._target(context)
        async for response in servicer.Generate(request, context):
            yield response

    async def GetModelInfo(self, request, context):
        return await (await self._target(context)).GetModelInfo(request, context)

    async def Tokenize(self, request, context):
        return await (await self._target(context)).Tokenize(request, context)


def _model_name(model: str) -> str:
    return pathlib.Path(model).name or model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxserve.api.server",
                                     description="jaxserve's api process")
    parser.add_argument("--engine-address", required=True, help="HOST:PORT of the engine process")
    parser.add_argument("--model", required=True, help="the model directory (for its tokenizer)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name GetModelInfo reports (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="Prometheus metrics HTTP port (0 = off)")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="sequences that may wait beyond max_num_seqs before new requests "
                             "get RESOURCE_EXHAUSTED")
    parser.add_argument("--engine-timeout", type=float, default=None,
                        help="seconds to wait for the engine at start-up (default: no limit)")
    parser.add_argument("--shutdown-grace", type=float, default=2.0,
                        help="seconds running calls get to finish at shutdown")
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("api", args.log_level)

    async def run() -> None:
        server = ApiServer(args)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.stop)
        await server.run()

    try:
        asyncio.run(run())
    except (RuntimeError, EngineError) as err:  # cannot bind; the engine never answered
        logger.error("api failed: %s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
