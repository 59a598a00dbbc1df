"""The engine process's step loop: one thread owns the ``EngineCore`` (jax-free).

``EngineCore`` is not thread-safe, so every operation on it runs on the loop
thread. Other threads (the gRPC handlers) submit **commands** — add a
request, abort, read the stats — as callables with a ``Future``; the loop runs
them between steps, so a command waits at most one step::

    while not stopping:
        run every queued command (add / abort / stats)
        if the core has unfinished requests: outputs = core.step(); publish(outputs)
        else: sleep until a command arrives

Outputs go to every **subscriber** (``subscribe()``: a queue per api
process's output stream) as one ``OutputBatch`` per step. A subscriber that
goes away (``unsubscribe``) takes no requests with it by itself; the service
aborts them (``abort_all``).

If ``step()`` raises (the worker died or hung: ``WorkerDiedError``, or any
bug), the loop stops stepping: every unfinished request fails with the
error's text in one ``OutputBatch(error=..., failed_request_ids=...)``,
``serving`` turns False, queued and later commands raise ``EngineDeadError``
and ``on_failure`` runs. Then, given a ``restart`` function, the loop
**recovers**: ``restart(old_core)`` disposes of the old worker and returns a
new ``EngineCore`` on a new worker (empty scheduler, every KV block free);
the loop swaps it in, ``serving`` turns True again and ``on_recovery`` runs.
Restarts are bounded: after ``max_restarts`` attempts in the loop's life
(failed attempts count) it gives up, stays failed and runs ``on_give_up``.
Without ``restart`` the first failure is final.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

from jaxserve.engine.core import EngineCore
from jaxserve.engine.messages import EngineCoreOutput, EngineCoreRequest, EngineStats

logger = logging.getLogger(__name__)

T = TypeVar("T")
# How long the loop sleeps when a step produced nothing but requests remain
# (e.g. they wait for blocks); a command wakes it earlier. Seconds.
_IDLE_POLL_S = 0.005


class EngineDeadError(RuntimeError):
    """The engine stopped serving (its worker died or a step failed)."""


@dataclasses.dataclass(frozen=True, slots=True)
class OutputBatch:
    """One step's outputs, or (with ``error``) the engine's failure.

    Attributes:
      outputs: the step's ``EngineCoreOutput``s, every request mixed.
      error: non-empty when the engine failed; the last batch a subscriber gets.
      failed_request_ids: the requests that were unfinished when it failed.
    """

    outputs: tuple[EngineCoreOutput, ...] = ()
    error: str = ""
    failed_request_ids: tuple[str, ...] = ()


class EngineLoop:
    """Runs an ``EngineCore`` on its own thread.

    Args:
      core: the engine core (its worker already initialized).
      on_failure: called (on the loop thread) with the error text each time
        the engine fails.
      restart: ``restart(old_core) -> new_core``: disposes of the failed
        core's worker and builds a new core on a new worker; None = no
        recovery. May raise (the attempt counts and is logged).
      max_restarts: restart attempts allowed in the loop's life.
      on_recovery: called (on the loop thread) once a new core serves.
      on_give_up: called (on the loop thread) when the engine failed and no
        restart is left (or none succeeded).

    Attributes:
      num_worker_restarts: restart attempts made (each starts a new worker).
    """

    def __init__(self, core: EngineCore,
                 on_failure: Callable[[str], None] | None = None, *,
                 restart: Callable[[EngineCore], EngineCore] | None = None,
                 max_restarts: int = 0,
                 on_recovery: Callable[[], None] | None = None,
                 on_give_up: Callable[[], None] | None = None) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.core = core
        self._on_failure = on_failure
        self._restart = restart
        self._max_restarts = max_restarts if restart is not None else 0
        self._on_recovery = on_recovery
        self._on_give_up = on_give_up
        self.num_worker_restarts = 0
        self._commands: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _commands, _subscribers, _error
        self._subscribers: list[queue.SimpleQueue[OutputBatch]] = []
        # request id -> indices of its unfinished completions (loop thread only)
        self._remaining: dict[str, set[int]] = {}
        self._error = ""
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stops the loop after the current step; pending commands fail with EngineDeadError."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def serving(self) -> bool:
        """False while the engine is failed (until it recovers) or stopping."""
        return not self._error and not self._stopping

    @property
    def error(self) -> str:
        """Why the engine failed ("" while serving)."""
        return self._error

    # -------------------------------------------------------------- commands
    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Runs ``fn`` on the loop thread between steps and returns its result.

        Raises:
          EngineDeadError: the engine failed or stopped before running it.
          Whatever ``fn`` raises.
        """
        future: Future = Future()
        with self._lock:
            if not self.serving:
                raise EngineDeadError(self._error or "the engine is shutting down")
            self._commands.append((fn, future))
        self._wake.set()
        return future.result(timeout)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a request in the core.

        Raises:
          ValueError / NotImplementedError: the core refused it.
          EngineDeadError: not serving.
        """
        def add() -> None:
            self.core.add_request(request)
            self._remaining[request.request_id] = set(range(request.sampling_params.n))

        # Structured outputs compile here, in the caller's thread, while the loop
        # steps: a bad schema, regex or grammar is refused before it is queued.
        self.core.check_structured_outputs(request.sampling_params)
        self.call(add)

    def abort(self, targets: Iterable[str | tuple[str, int]]) -> None:
        """Aborts requests (ids) or completions ((id, index)); frees their blocks."""
        targets = list(targets)

        def abort() -> None:
            self.core.abort_requests(targets)
            for target in targets:
                if isinstance(target, str):
                    self._remaining.pop(target, None)
                else:
                    self._forget(*target)

        self.call(abort)

    def abort_all(self) -> None:
        """Aborts every unfinished request."""
        def abort_all() -> None:
            self.core.abort_requests(list(self._remaining))
            self._remaining.clear()

        self.call(abort_all)

    def stats(self) -> EngineStats:
        """A snapshot taken on the loop thread (after the commands queued before it).

        While the engine is failed, the failed (or recovering) core's counters,
        read directly.
        """
        try:
            stats = self.call(self.core.stats)
        except EngineDeadError:
            stats = self.core.stats()
        return dataclasses.replace(stats, num_worker_restarts=self.num_worker_restarts)

    # ----------------------------------------------------------- subscribers
    def subscribe(self) -> "queue.SimpleQueue[OutputBatch]":
        """A new queue that receives every ``OutputBatch`` from now on.

        Raises:
          EngineDeadError: the engine is failed (until it recovers) or stopping.
        """
        q: queue.SimpleQueue[OutputBatch] = queue.SimpleQueue()
        with self._lock:
            if not self.serving:
                raise EngineDeadError(self._error or "the engine is shutting down")
            self._subscribers.append(q)
        return q

    @property
    def num_subscribers(self) -> int:
        """Output streams open now (the api process's, while it is connected)."""
        with self._lock:
            return len(self._subscribers)

    def unsubscribe(self, q: "queue.SimpleQueue[OutputBatch]") -> None:
        with self._lock:
            if q in self._subscribers:
                self._subscribers.remove(q)

    def _publish(self, batch: OutputBatch) -> None:
        with self._lock:
            for q in self._subscribers:
                q.put(batch)

    # ------------------------------------------------------------------ loop
    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                fn, future = self._commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except Exception as err:  # noqa: BLE001 - handed to the caller
                future.set_exception(err)

    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._serve()
                except Exception as err:  # noqa: BLE001 - the engine's failure path
                    logger.exception("engine step failed; the engine stops serving")
                    self._fail(f"{type(err).__name__}: {err}")
                    if not self._recover():
                        return
        finally:
            self._drain_commands()

    def _serve(self) -> None:
        """Runs commands and steps until stopping; raises what a step raises."""
        while not self._stopping:
            self._wake.clear()
            self._run_commands()
            if not self.core.has_unfinished_requests():
                self._wake.wait()
                continue
            outputs = self.core.step()
            if outputs:
                self._track(outputs)
                self._publish(OutputBatch(tuple(outputs)))
            else:
                self._wake.wait(_IDLE_POLL_S)

    def _recover(self) -> bool:
        """Replaces the failed core through ``restart``; False when none is left (gave up)."""
        while self.num_worker_restarts < self._max_restarts and not self._stopping:
            self.num_worker_restarts += 1
            attempt = f"{self.num_worker_restarts} of {self._max_restarts}"
            logger.warning("restarting the worker (attempt %s)", attempt)
            try:
                core = self._restart(self.core)
            except Exception:  # noqa: BLE001 - logged; the next attempt or giving up follows
                logger.exception("worker restart attempt %s failed", attempt)
                continue
            if self._stopping:  # stopped while the new worker started
                core.shutdown()
                return False
            with self._lock:
                self.core = core
                self._error = ""
            logger.warning("the engine serves again on a new worker (restart %s)", attempt)
            if self._on_recovery is not None:
                self._on_recovery()
            return True
        if not self._stopping:
            logger.error("the engine gives up: the worker failed and %d restart attempts "
                         "were allowed (--max-worker-restarts)", self._max_restarts)
            if self._on_give_up is not None:
                self._on_give_up()
        return False

    def _track(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                self._forget(out.request_id, out.index)

    def _forget(self, request_id: str, index: int) -> None:
        """Completion ``index`` of ``request_id`` is finished or aborted (idempotent)."""
        unfinished = self._remaining.get(request_id)
        if unfinished is not None:
            unfinished.discard(index)
            if not unfinished:
                del self._remaining[request_id]

    def _fail(self, message: str) -> None:
        with self._lock:
            self._error = message or "the engine failed"
        failed = tuple(self._remaining)
        self._remaining.clear()
        self._drain_commands()  # nothing queued for the failed core runs on a new one
        self._publish(OutputBatch(error=self._error, failed_request_ids=failed))
        if self._on_failure is not None:
            self._on_failure(self._error)

    def _drain_commands(self) -> None:
        """Fails the commands still queued (the engine failed, or the loop ends)."""
        with self._lock:
            pending, self._commands = list(self._commands), collections.deque()
        for _, future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(self._error or "the engine is shutting down"))
