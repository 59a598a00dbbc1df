"""The api process's side of ``jaxserve.EngineService`` (grpc.aio, jax-free).

``EngineClient`` opens one ``StreamOutputs`` stream to the engine and
demultiplexes it: each request registers an ``asyncio.Queue`` *before* it is
added (so no output can arrive unclaimed), and receives its
``EngineCoreOutput``s there. When the engine fails (its worker died) or the
stream breaks, every registered queue receives an ``EngineFailure`` and the
client stops serving (``on_failure`` callbacks run, e.g. to report
NOT_SERVING). It then tries to open the output stream again every
``RECONNECT_S`` seconds: the engine accepts once it serves again (on a new
worker); the client then serves again and ``on_recovery`` callbacks run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterable

import grpc

from jaxserve.engine.messages import EngineCoreRequest, EngineStats
from jaxserve.proto import engine_pb2 as epb
from jaxserve.proto import engine_pb2_grpc as epb_grpc
from jaxserve.proto.engine_convert import output_from_proto, request_to_proto, stats_from_proto

logger = logging.getLogger(__name__)


RECONNECT_S = 0.5  # between attempts to open the output stream after a failure
# Reconnect quickly while the engine starts (gRPC's default backoff grows to 2 min).
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineFailure:
    """Put in a request's queue when the engine can no longer finish it."""

    message: str


class EngineError(Exception):
    """An engine call failed; carries the gRPC status the engine answered."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


RequestQueue = asyncio.Queue  # of EngineCoreOutput | EngineFailure


class EngineClient:
    """Async client of the engine process.

    Args:
      address: ``host:port`` of the engine's EngineService.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = epb_grpc.EngineServiceStub(self._channel)
        self._queues: dict[str, RequestQueue] = {}
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._task: asyncio.Task | None = None
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._recovery_callbacks: list[Callable[[], None]] = []
        self._reconnect: asyncio.Task | None = None
        self._closing = False
        self.info: epb.EngineInfo | None = None
        self.error = ""
        self.latest_stats: EngineStats | None = None

    # ------------------------------------------------------------- lifecycle
    async def connect(self, timeout: float | None = None) -> epb.EngineInfo:
        """Waits for the engine, reads its info, and opens the output stream.

        Raises:
          EngineError: the engine did not answer within ``timeout`` seconds.
        """
        try:
            self.info = await self._stub.GetEngineInfo(epb.GetEngineInfoRequest(),
                                                       wait_for_ready=True, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise EngineError(err.code(), err.details() or "") from None
        await self._open_stream()
        return self.info

    async def _open_stream(self) -> None:
        """Opens ``StreamOutputs`` and starts dispatching it.

        Raises:
          EngineError: the engine refused (not serving) or did not answer.
        """
        call = self._stub.StreamOutputs(epb.StreamOutputsRequest())
        try:
            first = await call.read()  # the engine confirms the subscription
        except grpc.aio.AioRpcError as err:
            raise EngineError(err.code(), err.details() or "") from None
        if first is grpc.aio.EOF or first.error:
            call.cancel()
            raise EngineError(grpc.StatusCode.UNAVAILABLE,
                              getattr(first, "error", "") or "the engine closed its output stream")
        self._call = call
        self._task = asyncio.create_task(self._dispatch(), name="engine-outputs")

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Registers ``callback(error)``, called each time the engine fails or is lost."""
        self._failure_callbacks.append(callback)

    def on_recovery(self, callback: Callable[[], None]) -> None:
        """Registers ``callback()``, called each time the client serves again after a failure."""
        self._recovery_callbacks.append(callback)

    @property
    def serving(self) -> bool:
        return self._task is not None and not self.error

    async def close(self) -> None:
        """Closes the output stream (the engine aborts what is left) and the channel."""
        self._closing = True
        if self._reconnect is not None:
            self._reconnect.cancel()
            await asyncio.gather(self._reconnect, return_exceptions=True)
        if self._call is not None:
            self._call.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._channel.close()

    # -------------------------------------------------------------- requests
    def register(self, request_id: str) -> RequestQueue:
        """A new queue for ``request_id``'s outputs (before ``add``).

        Raises:
          KeyError: ``request_id`` is already registered.
        """
        if request_id in self._queues:
            raise KeyError(request_id)
        queue: RequestQueue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def is_registered(self, request_id: str) -> bool:
        return request_id in self._queues

    async def add(self, request: EngineCoreRequest) -> None:
        """Adds a registered request to the engine.

        Raises:
          EngineError: the engine refused it (INVALID_ARGUMENT, UNIMPLEMENTED)
            or is not serving (UNAVAILABLE).
        """
        if self.error:
            raise EngineError(grpc.StatusCode.UNAVAILABLE, self.error)
        try:
            await self._stub.AddRequest(request_to_proto(request))
        except grpc.aio.AioRpcError as err:
            raise EngineError(err.code(), err.details() or "") from None

    async def abort(self, targets: Iterable[str | tuple[str, int]]) -> None:
        """Aborts requests (ids) or completions ((id, index)); errors are logged, not raised."""
        message = epb.AbortRequestsRequest()
        for target in targets:
            if isinstance(target, str):
                message.targets.add(request_id=target)
            else:
                message.targets.add(request_id=target[0], index=target[1])
        if self.error:
            return
        try:
            await self._stub.AbortRequests(message, timeout=30)
        except grpc.aio.AioRpcError as err:
            logger.warning("abort of %d targets failed: %s", len(message.targets), err.details())

    async def stats(self, timeout: float | None = 10.0) -> tuple[EngineStats, bool, str]:
        """(stats, serving, error) from the engine, fresh.

        Raises:
          EngineError: the engine did not answer.
        """
        try:
            reply = await self._stub.GetStats(epb.GetStatsRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise EngineError(err.code(), err.details() or "") from None
        self.latest_stats = stats_from_proto(reply)
        return self.latest_stats, reply.serving, reply.error

    # -------------------------------------------------------------- dispatch
    async def _dispatch(self) -> None:
        assert self._call is not None
        try:
            while True:
                batch = await self._call.read()  # (read() and async-for must not be mixed)
                if batch is grpc.aio.EOF:
                    break
                for message in batch.outputs:
                    queue = self._queues.get(message.request_id)
                    if queue is not None:
                        queue.put_nowait(output_from_proto(message))
                if batch.error:
                    self._fail(f"the engine failed: {batch.error}")
                    return
            self._fail("the engine closed its output stream")
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                self._fail(f"lost the engine: {err.code().name}: {err.details()}")
        except Exception as err:  # noqa: BLE001 - a bug here must not pass silently
            logger.exception("the engine output dispatcher failed")
            self._fail(f"the api lost its engine stream: {type(err).__name__}: {err}")
            raise

    def _fail(self, message: str) -> None:
        if self.error:
            return
        self.error = message
        logger.error("%s; failing %d requests (engine at %s)", message, len(self._queues),
                     self.address)
        for queue in self._queues.values():
            queue.put_nowait(EngineFailure(message))
        for callback in self._failure_callbacks:
            callback(message)
        if not self._closing:
            self._reconnect = asyncio.create_task(self._reconnect_loop(), name="engine-reconnect")

    async def _reconnect_loop(self) -> None:
        """Reopens the output stream once the engine serves again; then serves again."""
        while True:
            await asyncio.sleep(RECONNECT_S)
            try:
                await self._open_stream()
            except EngineError as err:
                logger.debug("engine not serving yet: %s", err.message)
                continue
            logger.warning("the engine at %s serves again; so does the api", self.address)
            self.error = ""
            for callback in self._recovery_callbacks:
                callback()
            return

