"""The api process: the public servers — gRPC (``jaxserve.GenerateService``, health,
reflection) and the OpenAI-compatible HTTP API — over one ``RequestRunner``.

    python -m jaxserve.api.server --engine-address 127.0.0.1:50061 --model DIR \\
        [--engine-address 127.0.0.1:50062 ...]    # one per data-parallel replica
        [--host 0.0.0.0] [--port 50051] [--http-port 8000] [--metrics-port 9090] \\
        [--ssl-certfile CERT --ssl-keyfile KEY]    # API key: $JAXSERVE_API_KEY
        [--enable-auto-tool-choice --tool-call-parser hermes]    # chat tool_choice "auto"

Started by ``jaxserve serve`` (``jaxserve.launcher``). Start-up: bind the
ports at once (health NOT_SERVING, HTTP 503), load the tokenizer and the
model's default sampling parameters (``--generation-config``,
``jaxserve.generation_config``), wait for every engine process
(``EngineGroup.connect``: one per data-parallel replica, each ready once its
worker has loaded and compiled the model), then report SERVING for "" and
"jaxserve.GenerateService" and answer HTTP requests. Server reflection lists
GenerateService and Health. Prometheus metrics (``jaxserve.metrics``) are
served over HTTP on ``--metrics-port`` (0 = off). Both transports share the
request path (``jaxserve.api.runner``): validation, admission, the engine
client, detokenization and stop strings.

Security: with an API key (``$JAXSERVE_API_KEY``, set by ``jaxserve serve
--api-key``), gRPC calls of GenerateService need metadata ``authorization:
Bearer <key>`` (else ``UNAUTHENTICATED``; health and reflection stay open)
and HTTP requests the same header (else 401; ``/health`` stays open). With
``--ssl-certfile`` and ``--ssl-keyfile`` both transports use TLS. The
metrics port stays plain HTTP without a key (bind it to a private address).

NOT_SERVING again when the engine fails or is lost (its requests fail with
``UNAVAILABLE``); SERVING again once the engine serves again (on a new
worker: ``EngineClient`` reopens its output stream). With several replicas,
requests are routed to the least-loaded one; a failed replica's requests fail
with ``UNAVAILABLE`` and new ones go to the others, and the api turns
NOT_SERVING only while no replica serves (``jaxserve.api.engine_group``). SIGINT / SIGTERM drains:
health NOT_SERVING, new requests refused (``UNAVAILABLE``, HTTP 503), running
ones get up to ``--shutdown-grace`` seconds (default 30) to finish; then what
is left ends with finish reason "abort" and the process exits 0. A SIGINT after that
(a second Ctrl-C, passed on by the launcher) aborts at once; repeated SIGTERMs
do not (a supervisor may signal every process of the group, and the launcher
sends its own).
Never imports jax.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import signal
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.api.engine_client import EngineClient, EngineError
from jaxserve.api.engine_group import EngineGroup
from jaxserve.api.generate_service import SERVICE_NAME, GenerateServicer, stats_refresher
from jaxserve.api.openai.app import HttpFrontEnd, bearer_token_matches, http_server
from jaxserve.api.tool_parsers import add_tool_arguments, check_tool_arguments
from jaxserve.api.prompts import RequestPreparer
from jaxserve.api.runner import RequestRunner
from jaxserve.generation_config import AUTO, generation_config_source, load_sampling_defaults
from jaxserve.launcher import API_KEY_ENV, READY_LINE
from jaxserve.metrics import ServerMetrics
from jaxserve.procutil import die_with_launcher, keep_torch_out, setup_logging
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto import generate_pb2_grpc as pb_grpc
from jaxserve.status_details import status_details

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 2.0  # after the drain: for the aborted calls' last responses to go out

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DEFAULT_MAX_WAITING_REQUESTS = 256
DEFAULT_HTTP_PORT = 8000  # as vLLM's server


def load_tokenizer(path: str):
    """The model's Hugging Face tokenizer (as ``jaxserve.LLM`` loads it)."""
    from transformers import AutoTokenizer  # heavy import, kept local

    return AutoTokenizer.from_pretrained(path)


class ApiServer:
    """The api process's servers; ``await run()`` serves until ``stop()``.

    Args:
      args: parsed flags (see ``main``).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.api_key = os.environ.get(API_KEY_ENV) or None
        self.engine = EngineGroup([EngineClient(a) for a in args.engine_addresses])
        self.metrics = ServerMetrics(
            lambda: self.engine.latest_stats,
            lambda: self.runner.num_pending_seqs if self.runner is not None else 0,
            lambda: (self.engine.router.in_flight, self.engine.router.routed))
        self.health = health.aio.HealthServicer()
        self.runner: RequestRunner | None = None
        self.http = HttpFrontEnd(api_key=self.api_key,
                                 tool_parser=(args.tool_call_parser
                                              if args.enable_auto_tool_choice else None))
        self._stopped = asyncio.Event()
        self._abort_now = asyncio.Event()

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def stop(self) -> None:
        """Drains, then stops (see ``_drain``); on SIGTERM, however often it comes.

        Repeated SIGTERMs do not abort: a supervisor that signals the whole
        process group (systemd) and the launcher both send one.
        """
        self._stopped.set()

    def interrupt(self) -> None:
        """SIGINT: as ``stop``; a second one (Ctrl-C again, or the launcher passing on
        its own second signal) aborts what is running at once."""
        if self._stopped.is_set():
            self._abort_now.set()
        self._stopped.set()

    def _grpc_server(self) -> tuple[grpc.aio.Server, str]:
        args = self.args
        interceptors = [ApiKeyInterceptor(self.api_key)] if self.api_key else []
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], interceptors=interceptors)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["GenerateService"].full_name,
             health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{args.host}:{args.port}"
        if args.ssl_certfile:
            credentials = grpc.ssl_server_credentials([(
                pathlib.Path(args.ssl_keyfile).read_bytes(),
                pathlib.Path(args.ssl_certfile).read_bytes())])
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
        if bound == 0:
            raise RuntimeError(f"cannot bind {address}")
        return server, address

    async def run(self) -> None:
        args = self.args
        await self._set_health(NOT_SERVING)
        server, address = self._grpc_server()
        http_task = None
        if args.http_port:
            http, sock = http_server(self.http, host=args.host, port=args.http_port,
                                     ssl_certfile=args.ssl_certfile,
                                     ssl_keyfile=args.ssl_keyfile, shutdown_grace=_STOP_GRACE_S)
            http_task = asyncio.create_task(http.serve(sockets=[sock]))
            logger.info("HTTP (OpenAI-compatible) on %s://%s:%d", "https" if args.ssl_certfile
                        else "http", args.host, args.http_port)
        if args.metrics_port:  # bound now, so a busy port fails before the slow start-up
            try:
                self.metrics.serve(args.metrics_port, args.host)
            except OSError as err:
                raise RuntimeError(f"--metrics-port {args.metrics_port}: cannot listen on "
                                   f"{args.host}:{args.metrics_port}: {err.strerror}") from None
            logger.info("metrics on http://%s:%d/metrics", args.host, args.metrics_port)
        tokenizer = await asyncio.to_thread(load_tokenizer, args.model)
        if not getattr(tokenizer, "chat_template", None):
            logger.warning("the model has no chat template: chat requests will be refused "
                           "(INVALID_ARGUMENT / HTTP 400); text prompts work")
        try:
            defaults = await asyncio.to_thread(load_sampling_defaults, args.model,
                                               args.generation_config)
        except (OSError, ValueError) as err:
            raise RuntimeError(f"--generation-config {args.generation_config}: {err}") from None
        if defaults:
            logger.info("default sampling parameters from the generation config: %s", defaults)
        # Generate must exist before start (aio servers take no handlers later): it
        # answers UNAVAILABLE until the engine is connected.
        servicer: asyncio.Future = asyncio.get_running_loop().create_future()
        add_generate_service(_Deferred(servicer), server)
        await server.start()
        logger.info("api listening on %s; waiting for the engine at %s", address,
                    ", ".join(args.engine_addresses))
        try:
            await self._serve(tokenizer, defaults, servicer, address)
        finally:
            if http_task is not None:
                http.stop()
                await http_task
            await server.stop(grace=_STOP_GRACE_S)
            await self.engine.close()
            logger.info("api stopped")

    async def _serve(self, tokenizer: Any, defaults: dict[str, Any], servicer: asyncio.Future,
                     address: str) -> None:
        args = self.args
        connect = asyncio.create_task(self.engine.connect(timeout=args.engine_timeout))
        stopped = asyncio.create_task(self._stopped.wait())
        await asyncio.wait({connect, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not connect.done():  # stopped while waiting for the engine
            connect.cancel()
            return
        stopped.cancel()
        info = connect.result()  # raises EngineError when the engine never answered
        preparer = RequestPreparer(tokenizer, vocab_size=info.vocab_size,
                                   max_model_len=info.max_model_len,
                                   eos_token_ids=info.eos_token_ids,
                                   max_num_seqs=info.max_num_seqs, defaults=defaults)
        self.runner = RequestRunner(
            self.engine, preparer, model_name=args.served_model_name or _model_name(args.model),
            metrics=self.metrics,
            max_pending_seqs=self.engine.num_replicas * info.max_num_seqs
            + args.max_waiting_requests)
        servicer.set_result(GenerateServicer(self.runner, tool_parser=self.http.tool_parser))
        self.http.attach(self.runner)
        loop = asyncio.get_running_loop()
        self.engine.on_failure(
            lambda error: loop.create_task(self._set_health(NOT_SERVING)))
        self.engine.on_recovery(lambda: loop.create_task(self._set_health(SERVING)))
        refresh = asyncio.create_task(stats_refresher(self.engine)())
        await self._set_health(SERVING)
        print(READY_LINE, flush=True)
        logger.info("api serving %s on %s (max_model_len %d, %d usable KV blocks of %d tokens"
                    " per replica, %d replicas)", self.runner.model_name, address,
                    info.max_model_len, info.num_kv_blocks - 1, info.block_size,
                    self.engine.num_replicas)
        await self._stopped.wait()
        await self._set_health(NOT_SERVING)
        await self._drain()
        self.runner.begin_shutdown()
        refresh.cancel()

    async def _drain(self) -> None:
        """Refuses new requests and waits for the running ones, up to ``--shutdown-grace`` s.

        Ends early on a second stop signal; ``begin_shutdown`` then ends what
        is left with finish reason "abort".
        """
        runner, grace = self.runner, self.args.shutdown_grace
        runner.begin_drain()
        logger.info("api draining: %d sequences in flight, up to %.0f s (a second signal "
                    "aborts them)", runner.num_pending_seqs, grace)
        deadline = asyncio.get_running_loop().time() + grace
        while (runner.num_pending_seqs and not self._abort_now.is_set()
               and asyncio.get_running_loop().time() < deadline):
            try:
                await asyncio.wait_for(self._abort_now.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
        if runner.num_pending_seqs:
            logger.info("api shutting down: aborting %d sequences", runner.num_pending_seqs)
        else:
            logger.info("api shutting down: every request finished")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses GenerateService calls without metadata ``authorization: Bearer <key>``.

    Health and reflection stay open (probes, ``grpcurl list``).

    Args:
      api_key: the key.
    """

    def __init__(self, api_key: str) -> None:
        self._api_key = api_key

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "a valid API key is required (metadata authorization: "
                                "Bearer <key>)")

        self._refuse_unary = grpc.unary_unary_rpc_method_handler(refuse)
        self._refuse_stream = grpc.unary_stream_rpc_method_handler(refuse)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if not details.method.startswith(f"/{SERVICE_NAME}/"):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(given, bytes):
            given = given.decode(errors="replace")
        if bearer_token_matches(given, self._api_key):
            return await continuation(details)
        return (self._refuse_stream if details.method.endswith("/Generate")
                else self._refuse_unary)


class _Undecodable:
    """A request whose bytes are no valid message (its handler answers INVALID_ARGUMENT)."""

    __slots__ = ("message", "error")

    def __init__(self, message: str, error: str) -> None:
        self.message = message  # the expected message type's full name
        self.error = error


def _decoder(message_type: Any) -> Any:
    """``message_type.FromString`` that returns an ``_Undecodable`` instead of raising."""
    def decode(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as err:
            return _Undecodable(message_type.DESCRIPTOR.full_name, str(err))
    return decode


def add_generate_service(servicer: pb_grpc.GenerateServiceServicer, server: grpc.aio.Server) -> None:
    """``pb_grpc.add_GenerateServiceServicer_to_server`` with decoders that never raise.

    gRPC answers a request its deserializer cannot parse (corrupt bytes,
    invalid UTF-8 in a string field) with UNKNOWN; these decoders hand the
    handler an ``_Undecodable`` instead, which ``_Deferred`` refuses with
    INVALID_ARGUMENT naming the message type.
    """
    methods = (("Generate", grpc.unary_stream_rpc_method_handler, pb.GenerateRequest,
                pb.GenerateResponse),
               ("GetModelInfo", grpc.unary_unary_rpc_method_handler, pb.GetModelInfoRequest,
                pb.GetModelInfoResponse),
               ("Tokenize", grpc.unary_unary_rpc_method_handler, pb.TokenizeRequest,
                pb.TokenizeResponse))
    handlers = {name: make(getattr(servicer, name), request_deserializer=_decoder(request),
                           response_serializer=response.SerializeToString)
                for name, make, request, response in methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                          handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class _Deferred(pb_grpc.GenerateServiceServicer):
    """Forwards to the ``GenerateServicer`` once it exists; UNAVAILABLE before.

    An undecodable request gets INVALID_ARGUMENT (field ``request``).
    """

    def __init__(self, servicer: asyncio.Future) -> None:
        self._servicer = servicer

    async def _target(self, request: Any, context: grpc.aio.ServicerContext) -> GenerateServicer:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(
                f"request: not a valid {request.message} message: {request.error}"))
        if not self._servicer.done():
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the server is starting: the engine is not ready yet")
        return self._servicer.result()

    async def Generate(self, request, context):
        servicer = await self._target(request, context)
        async for response in servicer.Generate(request, context):
            yield response

    async def GetModelInfo(self, request, context):
        return await (await self._target(request, context)).GetModelInfo(request, context)

    async def Tokenize(self, request, context):
        return await (await self._target(request, context)).Tokenize(request, context)


def _model_name(model: str) -> str:
    return pathlib.Path(model).name or model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxserve.api.server", allow_abbrev=False,
                                     description="jaxserve's api process")
    parser.add_argument("--engine-address", dest="engine_addresses", action="append",
                        required=True, metavar="HOST:PORT",
                        help="an engine process; repeated, one per data-parallel replica "
                             "(replica 0 first)")
    parser.add_argument("--model", required=True, help="the model directory (for its tokenizer)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name GetModelInfo reports (default: the directory's name)")
    parser.add_argument("--generation-config", type=generation_config_source, default=AUTO,
                        help="default sampling parameters: auto = the model's "
                             "generation_config.json, vllm = none, or a directory with one")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051)")
    parser.add_argument("--http-port", type=int, default=0,
                        help="OpenAI-compatible HTTP API port (0 = off)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="Prometheus metrics HTTP port (0 = off)")
    parser.add_argument("--ssl-certfile", default=None,
                        help="TLS certificate (PEM) for gRPC and HTTP; needs --ssl-keyfile")
    parser.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="sequences that may wait beyond max_num_seqs (times the "
                             "replicas) before new requests get RESOURCE_EXHAUSTED")
    parser.add_argument("--engine-timeout", type=float, default=None,
                        help="seconds to wait for the engine at start-up (default: no limit)")
    parser.add_argument("--shutdown-grace", type=float, default=30.0,
                        help="on SIGINT / SIGTERM, seconds running requests get to finish "
                             "before they are aborted (a second signal aborts at once)")
    parser.add_argument("--log-level", default="INFO")
    add_tool_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    die_with_launcher()  # first: a launcher that dies from now on takes this process along
    keep_torch_out()  # before anything imports transformers
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        parser.error("--ssl-certfile and --ssl-keyfile go together")
    try:
        check_tool_arguments(args)
    except ValueError as err:
        parser.error(str(err))
    setup_logging("api", args.log_level)

    async def run() -> None:
        server = ApiServer(args)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, server.stop)
        loop.add_signal_handler(signal.SIGINT, server.interrupt)
        await server.run()

    try:
        asyncio.run(run())
    except (RuntimeError, EngineError) as err:  # cannot bind; the engine never answered
        logger.error("api failed: %s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
