"""``WorkerGroup.submit`` names a dead rank even when another rank's error arrives first.

A rank killed mid-step shows first as the surviving ranks' collective error
(gloo or NCCL: the peer closed its connection), which can reach the group
before the killed rank's own call reports its death. Stub ranks (no
processes, no jax) replay that order deterministically.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from jaxserve.engine.worker_group import WorkerGroup
from jaxserve.step_plan import WorkerDiedError


class StubRank:
    """A rank whose step future this test completes by hand."""

    def __init__(self, address: str):
        self.address, self.process, self.pid = address, None, None
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.death: WorkerDiedError | None = None
        self.killed = False

    def submit(self, plan) -> concurrent.futures.Future:
        return self.future

    def exited(self) -> WorkerDiedError | None:
        return self.death

    def kill(self, why: str) -> None:
        self.killed = True

    def shutdown(self) -> None:
        self.killed = True


def test_a_collective_error_first_still_names_the_dead_rank():
    ranks = [StubRank("r0"), StubRank("r1")]
    group = WorkerGroup(ranks)
    done = group.submit(type("Plan", (), {"step_id": 7})())
    ranks[1].death = WorkerDiedError("the worker at r1 died: killed by signal 9")
    ranks[0].future.set_exception(RuntimeError("worker at r0: gloo: connection closed by peer"))
    with pytest.raises(WorkerDiedError, match="r1 died"):
        done.result(timeout=5)
    assert group.dead


def test_a_rank_error_without_a_death_stays_that_error():
    ranks = [StubRank("r0"), StubRank("r1")]
    group = WorkerGroup(ranks)
    done = group.submit(type("Plan", (), {"step_id": 7})())
    ranks[0].future.set_exception(RuntimeError("worker at r0: out of memory"))
    with pytest.raises(RuntimeError, match="out of memory"):
        done.result(timeout=5)
    assert group.dead
