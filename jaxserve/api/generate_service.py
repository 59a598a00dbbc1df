"""The public ``jaxserve.GenerateService`` (grpc.aio), over the engine process (jax-free).

One ``Generate`` call, in order:

1. refuse if not serving (``UNAVAILABLE``: starting, shutting down, or the
   engine failed);
2. tokenize and validate (``RequestPreparer``: ``INVALID_ARGUMENT`` naming
   the field, ``UNIMPLEMENTED`` for ``prompt_logprobs``); a ``request_id``
   already running is ``INVALID_ARGUMENT`` too;
3. admission: at most ``max_pending_seqs`` sequences (completions) in flight
   — ``max_num_seqs`` running plus a bounded waiting queue — else
   ``RESOURCE_EXHAUSTED``;
4. register the request's output queue, add it to the engine, and turn its
   outputs into responses (``RequestTracker``: detokenization, stop strings;
   a stop string aborts that completion in the engine);
5. whatever ends the call early — the client cancels, the deadline passes
   (``DEADLINE_EXCEEDED``), the engine fails (``UNAVAILABLE``) — aborts the
   request in the engine, which frees its KV blocks.

On shutdown (``begin_shutdown``) unfinished requests get a last response with
finish reason "abort".
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from jaxserve.api.completions import RequestTracker
from jaxserve.api.engine_client import EngineClient, EngineError, EngineFailure
from jaxserve.api.prompts import RequestPreparer, Unsupported
from jaxserve.api.validation import InvalidArgument, validate_text
from jaxserve.engine.messages import EngineCoreRequest
from jaxserve.metrics import ServerMetrics
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto import generate_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "jaxserve.GenerateService"
_SHUTDOWN = object()  # put in a request's queue: finish it with reason "abort"


class GenerateServicer(pb_grpc.GenerateServiceServicer):
    """``GenerateService`` over an ``EngineClient``.

    Args:
      engine: the connected engine client.
      preparer: tokenizes and validates requests for the served model.
      model_name: reported by ``GetModelInfo``.
      metrics: the process's Prometheus metrics.
      max_pending_seqs: most sequences (completions) in flight, running or waiting.
    """

    def __init__(self, engine: EngineClient, preparer: RequestPreparer, *, model_name: str,
                 metrics: ServerMetrics, max_pending_seqs: int) -> None:
        self.engine = engine
        self.preparer = preparer
        self.model_name = model_name
        self.metrics = metrics
        self.max_pending_seqs = max_pending_seqs
        self.num_pending_seqs = 0
        self._queues: dict[str, asyncio.Queue] = {}
        self._background: set[asyncio.Task] = set()
        self._shutting_down = False

    # ------------------------------------------------------------- lifecycle
    def begin_shutdown(self) -> None:
        """Refuses new requests; finishes running ones with reason "abort"."""
        self._shutting_down = True
        for queue in self._queues.values():
            queue.put_nowait(_SHUTDOWN)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Runs ``coro`` in the background (survives the cancelled handler that started it)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                      message: str) -> None:
        self.metrics.rejected.labels(code=code.name).inc()
        await context.abort(code, message)

    # --------------------------------------------------------------- methods
    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.monotonic()
        if self._shutting_down or not self.engine.serving:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE,
                               self.engine.error or "the server is shutting down")
        try:
            prepared = self.preparer.prepare(request)
        except InvalidArgument as err:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except Unsupported as err:
            await self._reject(context, grpc.StatusCode.UNIMPLEMENTED, str(err))
        rid = request.request_id or f"req-{uuid.uuid4().hex}"
        if self.engine.is_registered(rid):
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"request_id: {rid!r} is already running")
        n = prepared.params.n
        if self.num_pending_seqs + n > self.max_pending_seqs:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the server's queue is full ({self.num_pending_seqs} sequences "
                               f"in flight, at most {self.max_pending_seqs}); retry later")
        tracker = RequestTracker(rid, self.preparer.tokenizer, prepared.prompt_token_ids,
                                 prepared.params, stream=request.stream, arrival_time=arrival)
        queue = self.engine.register(rid)
        self._queues[rid] = queue
        self.num_pending_seqs += n
        try:
            try:
                await self.engine.add(EngineCoreRequest(
                    rid, prepared.prompt_token_ids, prepared.params, time.time(),
                    request.cache_salt or None))
            except EngineError as err:
                await self._reject(context, err.code, err.message)
            self.metrics.prompt_tokens.inc(len(prepared.prompt_token_ids))
            async for response in self._responses(rid, tracker, queue, context):
                yield response
        finally:
            if not tracker.done:
                self._spawn(self.engine.abort([rid]))
            self.engine.unregister(rid)
            del self._queues[rid]
            self.num_pending_seqs -= n
            stats = tracker.completion_stats()
            self.metrics.generation_tokens.inc(sum(s[0] for s in stats))
            self.metrics.observe_request(arrival, tracker.first_token_time, time.monotonic(),
                                         stats)

    async def _responses(self, rid: str, tracker: RequestTracker, queue: asyncio.Queue,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        while not tracker.done:
            remaining = context.time_remaining()
            try:
                item = await asyncio.wait_for(queue.get(), remaining)
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "the deadline passed before the request finished")
            if item is _SHUTDOWN:
                for response in tracker.abort():
                    yield response
                return
            if isinstance(item, EngineFailure):
                await context.abort(grpc.StatusCode.UNAVAILABLE, item.message)
            responses, abort_completion = tracker.accept(item)
            if abort_completion:
                self._spawn(self.engine.abort([(rid, item.index)]))
            for response in responses:
                yield response

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        info = self.engine.info
        try:
            stats, _, _ = await self.engine.stats()
        except EngineError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine did not answer: {err}")
        return pb.GetModelInfoResponse(
            model=self.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            block_size=info.block_size,
            num_kv_blocks_free=stats.kv_blocks_total - stats.kv_blocks_used,
            num_kv_blocks_total=stats.kv_blocks_total, eos_token_ids=info.eos_token_ids)

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            kind = request.WhichOneof("input")
            if kind == "text":
                validate_text(request.text)
                return pb.TokenizeResponse(token_ids=self.preparer.encode_text(request.text),
                                           text=request.text)
            if kind == "chat":
                text, ids = self.preparer.encode_chat(request.chat)
                return pb.TokenizeResponse(token_ids=ids, text=text)
            raise InvalidArgument("input", "set one of text or chat")
        except InvalidArgument as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))


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
