"""The public ``jaxserve.GenerateService`` (grpc.aio), over the engine process (jax-free).

A thin transport over ``RequestRunner`` (``jaxserve.api.runner``), which the
HTTP API shares: ``Generate`` prepares the request, starts it and streams its
``GenerateResponse``s; an ``ApiError`` becomes the call's status (its gRPC
code and message, bounded by ``jaxserve.status_details``). Whatever ends the call early — the client cancels, the
deadline passes, the engine fails — closes the request, which aborts it in the
engine and frees its KV blocks.

A chat with tools and a ``tool_choice`` other than ``none`` gets, on each
completion's last response, the calls read out of the completion's whole text
(``GenerateResponse.tool_calls``, ``jaxserve.api.tool_calling``) and finish
reason ``TOOL_CALLS`` when it called any and then stopped: what the HTTP API
returns as ``message.tool_calls``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from jaxserve.api.engine_client import EngineClient, EngineError
from jaxserve.api.runner import ApiError, RequestRunner
from jaxserve.api.tool_calling import ToolCallPlan
from jaxserve.api.tool_parsers import ToolParser, new_tool_call_id
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
      tool_parser: the ``--tool-call-parser`` that reads ``tool_choice`` ``auto``
        replies (``--enable-auto-tool-choice``), or None: ``auto`` is refused.
    """

    def __init__(self, runner: RequestRunner, tool_parser: ToolParser | None = None) -> None:
        self.runner = runner
        self.tool_parser = tool_parser

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        runner = self.runner
        prepared = None
        try:
            runner.check_ready()
            prepared = runner.prepare(request, tool_parser=self.tool_parser)
            running = await runner.start(prepared, request_id=request.request_id,
                                         stream=request.stream, cache_salt=request.cache_salt,
                                         timeout=context.time_remaining())
        except ApiError as err:
            field = err.field or ""
            message = err.message
            if (field.startswith("sampling_params.structured_outputs") and prepared is not None
                    and prepared.tools.schema is not None):  # a tool's parameters did not compile
                message = "chat.tools" + message[len(field):]
            await context.abort(err.code, status_details(message))
        try:
            texts: dict[int, list[str]] = {}
            async for response in running.responses():
                if prepared.tools.parses:
                    _add_tool_calls(prepared.tools, response, texts)
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
            quantization=info.quantization, kv_cache_dtype=info.kv_cache_dtype)

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


def _add_tool_calls(tools: ToolCallPlan, response: pb.GenerateResponse,
                    texts: dict[int, list[str]]) -> None:
    """Collects ``response``'s text into ``texts[index]``; on a completion's last
    response, adds the calls of its whole text (fresh ids) and, for a completion that
    called and stopped, finish reason ``TOOL_CALLS``."""
    parts = texts.setdefault(response.index, [])
    parts.append(response.text)
    if not response.HasField("finished"):
        return
    _, calls = tools.extract("".join(texts.pop(response.index)))
    for call in calls:
        response.tool_calls.add(id=new_tool_call_id(), name=call.name, arguments=call.arguments)
    if calls and response.finished.reason == pb.FINISH_REASON_STOP:
        response.finished.reason = pb.FINISH_REASON_TOOL_CALLS


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
