"""The api process's engines: one ``EngineClient`` per data-parallel replica (grpc.aio, jax-free).

``jaxserve serve --data-parallel-size D`` runs D independent engine + worker
pairs (replicas) behind one api process. ``EngineGroup`` is what the api's
``RequestRunner`` talks to, with a plain server being a group of one; it offers
``EngineClient``'s request interface and routes by request id:

- ``register`` picks the replica for a new request (``ReplicaRouter``: the
  serving replica with the fewest requests in flight from this api process,
  ties to the lowest index); ``add``, ``abort`` and ``unregister`` go to the
  replica it was registered on, so a request's outputs, stop-string aborts and
  cancellation stay there;
- ``connect`` waits for every replica: the api reports SERVING only once all
  of them are ready;
- the group serves while at least one replica serves. When a replica's engine
  fails or is lost, its in-flight requests fail with ``UNAVAILABLE`` (as in a
  single-replica server) and new requests go to the others until it serves
  again; only when no replica serves does the api turn NOT_SERVING
  (``on_failure``), and it serves again as soon as one does (``on_recovery``);
- ``stats`` sums the replicas' ``EngineStats`` (``GetModelInfo``'s KV block
  counts); ``latest_stats`` keeps them per replica (Prometheus, labelled
  ``replica``).

All replicas run the same model with the same engine flags; ``connect``
checks that their ``EngineInfo`` agree on what the api relies on.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

import grpc

from jaxserve.api.engine_client import EngineClient, EngineError, RequestQueue
from jaxserve.api.router import NoReplicaAvailable, ReplicaRouter
from jaxserve.engine.messages import EngineCoreRequest, EngineStats
from jaxserve.proto import engine_pb2 as epb

# EngineInfo fields every replica must agree on (the api validates and tokenizes once).
_SHARED_INFO_FIELDS = ("model", "dtype", "block_size", "max_model_len", "vocab_size",
                       "eos_token_ids", "max_num_seqs", "max_num_batched_tokens", "quantization")


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The replicas' stats added field by field (the hit rate follows from the sums)."""
    return EngineStats(**{f.name: sum(getattr(s, f.name) for s in stats)
                          for f in dataclasses.fields(EngineStats)})


class EngineGroup:
    """The engines of all data-parallel replicas. See the module docstring.

    Args:
      replicas: one client per replica's engine, replica 0 first
        (``EngineClient(address)``; anything with its interface in tests).

    Attributes:
      replicas: one ``EngineClient`` per replica.
      router: which replica each in-flight request is on.
      info: replica 0's ``EngineInfo`` (all agree; per replica, not summed),
        after ``connect``.
    """

    def __init__(self, replicas: Sequence[EngineClient]) -> None:
        if not replicas:
            raise ValueError("replicas: at least one engine is required")
        self.replicas = list(replicas)
        self.router = ReplicaRouter(len(self.replicas))
        self.info: epb.EngineInfo | None = None

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    # ------------------------------------------------------------- lifecycle
    async def connect(self, timeout: float | None = None) -> epb.EngineInfo:
        """Waits for every replica's engine and opens their output streams.

        Raises:
          EngineError: an engine did not answer within ``timeout`` seconds, or
            the replicas disagree on the model or its limits
            (``FAILED_PRECONDITION``).
        """
        infos = await asyncio.gather(*(c.connect(timeout) for c in self.replicas))
        for i, info in enumerate(infos[1:], start=1):
            for name in _SHARED_INFO_FIELDS:
                if getattr(info, name) != getattr(infos[0], name):
                    raise EngineError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"replica {i}'s engine has {name} "
                                      f"{getattr(info, name)!r}, replica 0's "
                                      f"{getattr(infos[0], name)!r}")
        self.info = infos[0]
        return self.info

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.replicas))

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Registers ``callback(error)``, called each time the last serving replica fails."""
        def failed(_: str) -> None:
            if not self.serving:
                callback(self.error)
        for client in self.replicas:
            client.on_failure(failed)

    def on_recovery(self, callback: Callable[[], None]) -> None:
        """Registers ``callback()``, called each time a replica serves again after none did."""
        def recovered() -> None:
            if sum(c.serving for c in self.replicas) == 1:
                callback()
        for client in self.replicas:
            client.on_recovery(recovered)

    @property
    def serving(self) -> bool:
        """At least one replica serves."""
        return any(c.serving for c in self.replicas)

    @property
    def error(self) -> str:
        """Why no replica serves ("" while one does), with each replica's error."""
        if self.serving:
            return ""
        if self.num_replicas == 1:
            return self.replicas[0].error
        return "; ".join(f"replica {i}: {c.error or 'not connected'}"
                         for i, c in enumerate(self.replicas))

    # -------------------------------------------------------------- requests
    def register(self, request_id: str) -> RequestQueue:
        """Routes ``request_id`` to a serving replica; its output queue there (before ``add``).

        Raises:
          KeyError: ``request_id`` is already registered.
          EngineError: ``UNAVAILABLE``, no replica serves.
        """
        try:
            replica = self.router.assign(request_id, [c.serving for c in self.replicas])
        except NoReplicaAvailable:
            raise EngineError(grpc.StatusCode.UNAVAILABLE,
                              self.error or "no replica is serving") from None
        return self.replicas[replica].register(request_id)

    def unregister(self, request_id: str) -> None:
        replica = self.router.release(request_id)
        if replica is not None:
            self.replicas[replica].unregister(request_id)

    def is_registered(self, request_id: str) -> bool:
        return self.router.replica_of(request_id) is not None

    async def add(self, request: EngineCoreRequest) -> None:
        """Adds a registered request to its replica's engine (``EngineClient.add``).

        Raises:
          EngineError: as ``EngineClient.add``.
          KeyError: the request is not registered.
        """
        replica = self.router.replica_of(request.request_id)
        if replica is None:
            raise KeyError(request.request_id)
        await self.replicas[replica].add(request)

    def abort(self, targets: Iterable[str | tuple[str, int]]) -> Coroutine[Any, Any, None]:
        """A coroutine that aborts ids or (id, index) completions on their replicas.

        The replicas are looked up now, not when the coroutine runs: a request
        is often unregistered before its abort is sent. Unregistered ids are
        skipped; errors are logged, not raised (``EngineClient.abort``).
        """
        by_replica: dict[int, list[str | tuple[str, int]]] = {}
        for target in targets:
            replica = self.router.replica_of(target if isinstance(target, str) else target[0])
            if replica is not None:
                by_replica.setdefault(replica, []).append(target)
        return self._abort(by_replica)

    async def _abort(self, by_replica: dict[int, list[str | tuple[str, int]]]) -> None:
        await asyncio.gather(*(self.replicas[i].abort(t) for i, t in by_replica.items()))

    # ----------------------------------------------------------------- stats
    async def stats(self, timeout: float | None = 10.0) -> tuple[EngineStats, bool, str]:
        """(stats summed over the replicas, serving, error), fresh.

        Raises:
          EngineError: a replica's engine did not answer.
        """
        replies = await asyncio.gather(*(c.stats(timeout) for c in self.replicas))
        return sum_stats([s for s, _, _ in replies]), self.serving, self.error

    @property
    def latest_stats(self) -> list[EngineStats | None]:
        """Each replica's latest stats (None before its first refresh)."""
        return [c.latest_stats for c in self.replicas]
