"""``ReplicaRouter``: least-loaded routing over data-parallel replicas (no processes)."""

from __future__ import annotations

import random

import pytest

from jaxserve.api.router import NoReplicaAvailable, ReplicaRouter


def test_new_requests_go_to_the_replica_with_fewest_in_flight_ties_to_the_lowest_index():
    router = ReplicaRouter(3)
    assert [router.assign(f"r{i}") for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert router.in_flight == (3, 2, 2)
    assert router.release("r1") == 1
    assert router.assign("x") == 1  # 1 now has the fewest (1 < 2)
    assert router.release("r2") == 2 and router.release("r5") == 2
    assert router.assign("y") == 2
    assert router.in_flight == (3, 2, 1) and router.routed == (3, 3, 3)


def test_a_request_stays_on_its_replica_until_released():
    router = ReplicaRouter(2)
    router.assign("a")
    router.assign("b")
    assert router.replica_of("a") == 0 and router.replica_of("b") == 1
    with pytest.raises(KeyError):
        router.assign("a")  # still in flight
    assert router.release("a") == 0
    assert router.replica_of("a") is None
    assert router.release("a") is None  # idempotent
    assert router.in_flight == (0, 1)
    assert router.assign("a") == 0  # the id may run again once released


def test_unavailable_replicas_get_no_requests():
    router = ReplicaRouter(3)
    assert [router.assign(f"r{i}", [True, False, True]) for i in range(4)] == [0, 2, 0, 2]
    assert router.assign("x", [False, True, False]) == 1
    with pytest.raises(NoReplicaAvailable):
        router.assign("y", [False, False, False])
    assert router.replica_of("y") is None and router.in_flight == (2, 1, 2)
    with pytest.raises(ValueError, match="2 entries for 3 replicas"):
        router.assign("z", [True, True])


def test_one_replica_takes_everything():
    router = ReplicaRouter(1)
    assert {router.assign(str(i)) for i in range(5)} == {0}
    assert router.in_flight == (5,)


@pytest.mark.parametrize("bad", [0, -1])
def test_at_least_one_replica(bad):
    with pytest.raises(ValueError, match=f"num_replicas must be >= 1, got {bad}"):
        ReplicaRouter(bad)


def test_random_traffic_always_picks_a_least_loaded_replica():
    rng = random.Random(0)
    router = ReplicaRouter(4)
    live: list[str] = []
    for step in range(500):
        if live and rng.random() < 0.4:
            router.release(live.pop(rng.randrange(len(live))))
            continue
        before = router.in_flight
        live.append(f"r{step}")
        replica = router.assign(live[-1])
        assert before[replica] == min(before)
        assert replica == before.index(min(before))  # ties: the lowest index
        assert sum(router.in_flight) == len(live)
    assert all(router.replica_of(r) is not None for r in live)

