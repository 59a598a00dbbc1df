"""Which data-parallel replica serves a request: least loaded first (pure logic, jax-free).

The api process counts the requests it has in flight on each replica (engine
+ worker pair). A new request goes to the available replica with the fewest;
ties go to the lowest index. A request stays on its replica until it is
released: its outputs, aborts and cancellation all go there.

    router = ReplicaRouter(2)
    router.assign("a")            # -> 0
    router.assign("b")            # -> 1
    router.release("a")           # -> 0
    router.assign("c", [False, True])  # -> 1 (replica 0 is not serving)

Load is counted in requests (not sequences or tokens), as the api sees them:
a replica's queue inside its engine is not consulted.
"""

from __future__ import annotations

from collections.abc import Sequence


class NoReplicaAvailable(RuntimeError):
    """No replica is available to take a request."""


class ReplicaRouter:
    """Least-loaded routing over ``num_replicas`` replicas. See the module docstring.

    Args:
      num_replicas: how many replicas (``--data-parallel-size``), at least 1.

    Raises:
      ValueError: ``num_replicas`` < 1.
    """

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self._in_flight = [0] * num_replicas  # [num_replicas] requests assigned, not released
        self._routed = [0] * num_replicas  # [num_replicas] requests ever assigned
        self._replica_of: dict[str, int] = {}

    @property
    def num_replicas(self) -> int:
        return len(self._in_flight)

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Requests in flight per replica."""
        return tuple(self._in_flight)

    @property
    def routed(self) -> tuple[int, ...]:
        """Requests ever assigned per replica (since start)."""
        return tuple(self._routed)

    def replica_of(self, request_id: str) -> int | None:
        """The replica ``request_id`` was assigned to, or None when it is not in flight."""
        return self._replica_of.get(request_id)

    def assign(self, request_id: str, available: Sequence[bool] | None = None) -> int:
        """Assigns ``request_id`` to the least-loaded available replica; returns its index.

        Args:
          request_id: a request not in flight.
          available: per replica, whether it may take requests (default: all).

        Raises:
          KeyError: ``request_id`` is already in flight.
          ValueError: ``available`` does not have one entry per replica.
          NoReplicaAvailable: no replica is available.
        """
        if request_id in self._replica_of:
            raise KeyError(request_id)
        if available is None:
            available = [True] * self.num_replicas
        elif len(available) != self.num_replicas:
            raise ValueError(f"available: {len(available)} entries for {self.num_replicas} "
                             f"replicas")
        candidates = [i for i, ok in enumerate(available) if ok]
        if not candidates:
            raise NoReplicaAvailable("no replica is available")
        replica = min(candidates, key=lambda i: (self._in_flight[i], i))
        self._replica_of[request_id] = replica
        self._in_flight[replica] += 1
        self._routed[replica] += 1
        return replica

    def release(self, request_id: str) -> int | None:
        """Ends ``request_id``'s assignment; returns its replica (None if it was not in flight)."""
        replica = self._replica_of.pop(request_id, None)
        if replica is not None:
            self._in_flight[replica] -= 1
        return replica
