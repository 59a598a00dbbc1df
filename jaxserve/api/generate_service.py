"""The public ``jaxserve.GenerateService`` (grpc.aio), over the engine process (jax-free).

A thin transport over ``RequestRunner`` (``jaxserve.api.runner``), which the
HTTP API shares: ``Generate`` prepares the request, starts it and streams its
``GenerateResponse``s; an ``ApiError`` becomes the call's status (its gRPC
code and message, bounded by ``jaxserve.status_details``). Whatever ends the call early — the client cancels, the
deadline passes, the engine fails — closes the request, which aborts it in the
engine and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from jaxserve.api.engine_client import EngineClient, EngineError
from jaxserve.api.runner import ApiError, RequestRunner
from jaxserve.api.validation import validate_text
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto import generate_pb2_grpc as pb_grpc
from jaxserve.status_details import status_details
from jaxserve.validation import InvalidArgument

logger = logging.getLogger(__name__)

SERVICE_NAME = "jaxserve.GenerateService"


class GenerateServicer(pb_grpc.GenerateServiceServicer):
    """``GenerateService`` over a ``RequestRunner``.

    Args:
      runner: the api process's request runner (engine, preparer, admission).
    """

    def __init__(self, runner: RequestRunner) -> None:
        self.runner = runner

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        runner = self.runner
        try:
            runner.check_ready()
            prepared = runner.prepare(request)
            running = await runner.start(prepared, request_id=request.request_id,
                                         stream=request.stream, cache_salt=request.cache_salt,
                                         timeout=context.time_remaining())
        except ApiError as err:
            await context.abort(err.code, status_details(err.message))
        try:
            async for response in running.responses():
                yield response
        except ApiError as err:
            await context.abort(err.code, status_details(err.message))
        finally:
            running.close()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        engine = self.runner.engine
        info = engine.info
        try:
            stats, _, _ = await engine.stats()
        except EngineError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                status_details(f"the engine did not answer: {err}"))
        return pb.GetModelInfoResponse(
            model=self.runner.model_name, max_model_len=info.max_model_len,
            vocab_size=info.vocab_size, block_size=info.block_size,
            num_kv_blocks_free=stats.kv_blocks_total - stats.kv_blocks_used,
            num_kv_blocks_total=stats.kv_blocks_total, eos_token_ids=info.eos_token_ids,
            quantization=info.quantization)

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        preparer = self.runner.preparer
        try:
            kind = request.WhichOneof("input")
            if kind == "text":
                validate_text(request.text)
                return pb.TokenizeResponse(token_ids=preparer.encode_text(request.text),
                                           text=request.text)
            if kind == "chat":
                text, ids = preparer.encode_chat(request.chat)
                return pb.TokenizeResponse(token_ids=ids, text=text)
            raise InvalidArgument("input", "set one of text or chat")
        except InvalidArgument as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(str(err)))


def stats_refresher(engine: EngineClient, period_s: float = 1.0
                    ) -> Callable[[], Coroutine[Any, Any, None]]:
    """A coroutine function that refreshes ``engine.latest_stats`` every ``period_s`` seconds."""
    async def refresh() -> None:
        while True:
            try:
                await engine.stats(timeout=period_s * 5)
            except EngineError as err:
                logger.debug("stats refresh failed: %s", err)
            await asyncio.sleep(period_s)

    return refresh
