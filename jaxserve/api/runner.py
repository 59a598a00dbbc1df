"""One request's life in the api process, shared by the gRPC and HTTP transports (jax-free).

``RequestRunner`` is the single implementation behind ``GenerateService`` and
the OpenAI-compatible HTTP API; a transport only maps its own wire format to
a ``PreparedRequest`` and ``ApiError`` codes to its own statuses. In order:

1. ``check_ready``: refuse when not serving (``UNAVAILABLE``: shutting down,
   or the engine failed or was lost);
2. ``prepare``: tokenize and validate (``RequestPreparer``); errors become
   ``ApiError(INVALID_ARGUMENT)`` naming the field, or ``UNIMPLEMENTED``;
3. ``start``: a ``request_id`` already running is ``INVALID_ARGUMENT``;
   admission allows at most ``max_pending_seqs`` sequences (completions) in
   flight — ``max_num_seqs`` running plus a bounded waiting queue — else
   ``RESOURCE_EXHAUSTED``; then the request is routed to a data-parallel
   replica (``EngineGroup``; one in a plain server), its output queue
   registered there and the request added to that replica's engine under an
   **engine request id** unique to this call (``<request_id>-<8 hex>``, as
   vLLM's internal request id): the client's id may be reused as soon as its
   request finished here, while the engine still drops the old one (a stop
   string's abort is in flight, its last tokens are on the wire), and the
   registration, abort and outputs of each call never touch another's;
4. ``RunningRequest.responses()`` turns engine outputs into
   ``GenerateResponse`` messages (``RequestTracker``: detokenization, stop
   strings; a stop string aborts that completion in the engine);
5. ``RunningRequest.close()`` (idempotent; ``responses()`` calls it when it
   ends, and a transport calls it whatever happens): a request that did not
   finish — the client went away, the deadline passed (``DEADLINE_EXCEEDED``),
   the engine failed (``UNAVAILABLE``) — is aborted in the engine, which
   frees its KV blocks; metrics are recorded.

On shutdown the api process first drains (``begin_drain``: new requests are
refused, running ones go on), then ``begin_shutdown`` gives every unfinished
request a last response with finish reason "abort". Every refusal is counted in
``jaxserve_requests_rejected_total`` by gRPC status code name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

import grpc

from jaxserve.api.completions import RequestTracker
from jaxserve.api.engine_client import EngineError, EngineFailure
from jaxserve.api.engine_group import EngineGroup
from jaxserve.api.prompts import PreparedRequest, RequestPreparer
from jaxserve.api.tool_parsers import ToolParser
from jaxserve.engine.messages import EngineCoreRequest
from jaxserve.metrics import ServerMetrics
from jaxserve.proto import generate_pb2 as pb
from jaxserve.validation import InvalidArgument, Unsupported

logger = logging.getLogger(__name__)

_SHUTDOWN = object()  # put in a request's queue: finish it with reason "abort"


class ApiError(Exception):
    """A request refused or failed; each transport maps ``code`` to its own status.

    Attributes:
      code: the gRPC status code (HTTP maps it: 400, 404, 429, 503, ...).
      message: what went wrong, for the client.
      field: the offending request field as ``GenerateRequest`` names it
        (``"sampling_params.top_p"``), or None.
    """

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field


class RequestRunner:
    """Runs requests against the engine for every transport. See the module docstring.

    Args:
      engine: the connected engines (one per data-parallel replica; a request
        stays on the replica ``EngineGroup`` routes it to).
      preparer: tokenizes and validates requests for the served model.
      model_name: the served model's name (``GetModelInfo``, the HTTP ``model`` field).
      metrics: the process's Prometheus metrics.
      max_pending_seqs: most sequences (completions) in flight, running or waiting.
    """

    def __init__(self, engine: EngineGroup, preparer: RequestPreparer, *, model_name: str,
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
    @property
    def ready(self) -> bool:
        """New requests are accepted (not shutting down, an engine serving)."""
        return not self._shutting_down and self.engine.serving

    def begin_drain(self) -> None:
        """Refuses new requests (``UNAVAILABLE``); running ones go on."""
        self._shutting_down = True

    def begin_shutdown(self) -> None:
        """Refuses new requests; finishes running ones with reason "abort"."""
        self._shutting_down = True
        for queue in self._queues.values():
            queue.put_nowait(_SHUTDOWN)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Runs ``coro`` in the background (survives the cancelled handler that started it)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def reject(self, code: grpc.StatusCode, message: str, field: str | None = None) -> ApiError:
        """An ``ApiError`` to raise, counted in the rejected-requests metric."""
        self.metrics.rejected.labels(code=code.name).inc()
        return ApiError(code, message, field)

    # --------------------------------------------------------------- requests
    def check_ready(self) -> None:
        """Raises:
          ApiError: ``UNAVAILABLE`` while shutting down or when the engine is lost.
        """
        if not self.ready:
            raise self.reject(grpc.StatusCode.UNAVAILABLE,
                              self.engine.error or "the server is shutting down")

    def prepare(self, request: pb.GenerateRequest, *,
                tool_parser: ToolParser | None = None) -> PreparedRequest:
        """``RequestPreparer.prepare`` with its errors as ``ApiError``."""
        with self.preparer_errors():
            return self.preparer.prepare(request, tool_parser=tool_parser)

    @contextlib.contextmanager
    def preparer_errors(self) -> Iterator[None]:
        """Maps ``InvalidArgument`` / ``Unsupported`` raised inside to ``ApiError``."""
        try:
            yield
        except Unsupported as err:
            raise self.reject(grpc.StatusCode.UNIMPLEMENTED, str(err), err.field) from None
        except InvalidArgument as err:
            raise self.reject(grpc.StatusCode.INVALID_ARGUMENT, str(err), err.field) from None

    async def start(self, prepared: PreparedRequest, *, request_id: str = "",
                    stream: bool = True, cache_salt: str = "",
                    timeout: float | None = None) -> "RunningRequest":
        """Admits ``prepared`` and adds it to the engine.

        Args:
          prepared: from ``prepare`` (or the HTTP front end's own mapping).
          request_id: "" picks ``req-<uuid>``.
          stream: responses per step, or one per completion.
          cache_salt: separates prefix-cache entries ("" = shared).
          timeout: seconds until the deadline (``DEADLINE_EXCEEDED``), or None.

        Raises:
          ApiError: ``INVALID_ARGUMENT`` (the id is already running),
            ``RESOURCE_EXHAUSTED`` (the queue is full), ``UNAVAILABLE`` or the
            engine's code (the engine refused or failed).
        """
        arrival = time.monotonic()
        self.check_ready()
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._queues:
            raise self.reject(grpc.StatusCode.INVALID_ARGUMENT,
                              f"request_id: {rid!r} is already running", "request_id")
        n = prepared.params.n
        if self.num_pending_seqs + n > self.max_pending_seqs:
            raise self.reject(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the server's queue is full ({self.num_pending_seqs} sequences "
                              f"in flight, at most {self.max_pending_seqs}); retry later")
        tracker = RequestTracker(rid, self.preparer.tokenizer, prepared.prompt_token_ids,
                                 prepared.params, stream=stream, arrival_time=arrival)
        engine_rid = f"{rid}-{uuid.uuid4().hex[:8]}"  # unique to this call (module docstring)
        try:
            queue = self.engine.register(engine_rid)  # routes it to a replica
        except EngineError as err:
            raise self.reject(err.code, err.message) from None
        running = RunningRequest(self, rid, engine_rid, tracker, queue, n, arrival,
                                 None if timeout is None else arrival + timeout)
        self._queues[rid] = running.queue
        self.num_pending_seqs += n
        try:
            await self.engine.add(EngineCoreRequest(
                engine_rid, prepared.prompt_token_ids, prepared.params, time.time(),
                cache_salt or None))
        except EngineError as err:
            running.close()
            # The engine names a refused field first ("sampling_params.structured_outputs.json:
            # ..." for a schema that does not compile).
            field = _LEADING_FIELD.match(err.message) if (
                err.code == grpc.StatusCode.INVALID_ARGUMENT) else None
            raise self.reject(err.code, err.message,
                              field.group(1) if field else None) from None
        except BaseException:
            running.close()
            raise
        self.metrics.prompt_tokens.inc(len(prepared.prompt_token_ids))
        return running

    def _release(self, running: "RunningRequest") -> None:
        if not running.tracker.done:
            self.spawn(self.engine.abort([running.engine_request_id]))
        self.engine.unregister(running.engine_request_id)
        self._queues.pop(running.request_id, None)
        self.num_pending_seqs -= running.num_seqs
        stats = running.tracker.completion_stats()
        self.metrics.generation_tokens.inc(sum(s[0] for s in stats))
        self.metrics.observe_request(running.arrival, running.tracker.first_token_time,
                                     time.monotonic(), stats)


_LEADING_FIELD = re.compile(r"^(sampling_params(?:\.[A-Za-z_]\w*)+): ")


class RunningRequest:
    """A request admitted to the engine: its responses, then ``close()``.

    Attributes:
      request_id: the client's id for it (in every response).
      engine_request_id: the engine's id for it, unique to this call.
      tracker: its ``RequestTracker`` (prompt and completion counts for usage).
    """

    def __init__(self, runner: RequestRunner, request_id: str, engine_request_id: str,
                 tracker: RequestTracker, queue: asyncio.Queue, num_seqs: int, arrival: float,
                 deadline: float | None) -> None:
        self._runner = runner
        self.request_id = request_id
        self.engine_request_id = engine_request_id
        self.tracker = tracker
        self.queue = queue
        self.num_seqs = num_seqs
        self.arrival = arrival
        self._deadline = deadline
        self._closed = False

    def close(self) -> None:
        """Aborts the request in the engine if it has not finished; idempotent."""
        if not self._closed:
            self._closed = True
            self._runner._release(self)

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        """The request's responses until every completion finished; then ``close()``.

        Raises:
          ApiError: ``DEADLINE_EXCEEDED`` (the deadline passed) or
            ``UNAVAILABLE`` (the engine failed).
        """
        tracker = self.tracker
        try:
            while not tracker.done:
                remaining = (None if self._deadline is None
                             else max(0.0, self._deadline - time.monotonic()))
                try:
                    item = await asyncio.wait_for(self.queue.get(), remaining)
                except asyncio.TimeoutError:
                    raise ApiError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   "the deadline passed before the request finished") from None
                if item is _SHUTDOWN:
                    for response in tracker.abort():
                        yield response
                    return
                if isinstance(item, EngineFailure):
                    raise ApiError(grpc.StatusCode.UNAVAILABLE, item.message)
                responses, abort_completion = tracker.accept(item)
                if abort_completion:
                    self._runner.spawn(self._runner.engine.abort(
                        [(self.engine_request_id, item.index)]))
                for response in responses:
                    yield response
        finally:
            self.close()
