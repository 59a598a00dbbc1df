"""``EngineGroup`` over fake engine clients, and the per-replica metrics (no processes).

The fakes record what reaches each replica, so the tests check that a
request's add and aborts go to the replica it was routed to, that a failed
replica gets no new requests, and that health callbacks fire only when the
last replica fails and when the first comes back.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from jaxserve.api.engine_client import EngineError
from jaxserve.api.engine_group import EngineGroup, sum_stats
from jaxserve.engine.messages import EngineCoreRequest, EngineStats
from jaxserve.metrics import ServerMetrics
from jaxserve.sampling_params import SamplingParams


def _stats(**values: float) -> EngineStats:
    base = {f.name: 0 for f in dataclasses.fields(EngineStats)}
    return EngineStats(**{**base, **values})


class FakeClient:
    """``EngineClient``'s interface, in memory."""

    def __init__(self, stats: EngineStats) -> None:
        self.error = ""
        self.queues: dict[str, asyncio.Queue] = {}
        self.added: list[str] = []
        self.aborted: list[object] = []
        self.latest_stats: EngineStats | None = None
        self._stats = stats
        self._failure: list = []
        self._recovery: list = []

    @property
    def serving(self) -> bool:
        return not self.error

    def on_failure(self, callback) -> None:
        self._failure.append(callback)

    def on_recovery(self, callback) -> None:
        self._recovery.append(callback)

    def fail(self, message: str) -> None:
        self.error = message
        for callback in self._failure:
            callback(message)

    def recover(self) -> None:
        self.error = ""
        for callback in self._recovery:
            callback()

    def register(self, request_id: str) -> asyncio.Queue:
        self.queues[request_id] = asyncio.Queue()
        return self.queues[request_id]

    def unregister(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    async def add(self, request: EngineCoreRequest) -> None:
        self.added.append(request.request_id)

    async def abort(self, targets) -> None:
        self.aborted += list(targets)

    async def stats(self, timeout=None):
        self.latest_stats = self._stats
        return self._stats, self.serving, self.error


def _request(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=2), 0.0)


def test_requests_and_their_aborts_stay_on_the_replica_they_were_routed_to():
    async def run():
        a, b = FakeClient(_stats()), FakeClient(_stats())
        group = EngineGroup([a, b])
        for rid in ("r0", "r1", "r2"):
            group.register(rid)
            await group.add(_request(rid))
        assert a.added == ["r0", "r2"] and b.added == ["r1"]
        assert group.is_registered("r1") and not group.is_registered("x")
        abort = group.abort(["r1", ("r2", 0), "unknown"])
        group.unregister("r1")  # the runner unregisters before the abort task runs
        await abort
        assert a.aborted == [("r2", 0)] and b.aborted == ["r1"]
        assert "r1" not in b.queues and group.router.in_flight == (2, 0)
        with pytest.raises(KeyError):
            group.register("r0")

    asyncio.run(run())


def test_a_failed_replica_gets_no_new_requests_and_health_follows_the_last_one():
    a, b = FakeClient(_stats()), FakeClient(_stats())
    group = EngineGroup([a, b])
    events: list[str] = []
    group.on_failure(lambda error: events.append(f"down: {error}"))
    group.on_recovery(lambda: events.append("up"))
    a.fail("worker died")
    assert group.serving and group.error == "" and events == []
    group.register("r0")
    group.register("r1")
    assert group.router.in_flight == (0, 2)  # all to replica 1
    b.fail("lost the engine")
    assert not group.serving
    assert events == ["down: replica 0: worker died; replica 1: lost the engine"]
    with pytest.raises(EngineError) as err:
        group.register("r2")
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "worker died" in err.value.message
    b.recover()
    a.recover()  # the second recovery changes nothing: the group already serves
    assert events[1:] == ["up"] and group.serving


def test_a_single_replica_reports_its_own_error():
    client = FakeClient(_stats())
    group = EngineGroup([client])
    client.fail("the engine failed: worker died")
    assert group.error == "the engine failed: worker died"


def test_stats_sum_over_replicas_and_metrics_carry_a_replica_label():
    async def run():
        a = FakeClient(_stats(kv_blocks_total=100, kv_blocks_used=10, kv_blocks_free=90,
                              num_running=2, prefix_cache_queries=10, prefix_cache_hits=5))
        b = FakeClient(_stats(kv_blocks_total=100, kv_blocks_used=30, kv_blocks_free=70,
                              num_running=3, prefix_cache_queries=30, prefix_cache_hits=0,
                              num_worker_restarts=1))
        group = EngineGroup([a, b])
        total, serving, error = await group.stats()
        return group, total, serving, error

    group, total, serving, error = asyncio.run(run())
    assert (total.kv_blocks_total, total.kv_blocks_used, total.num_running) == (200, 40, 5)
    assert total.prefix_cache_hit_rate == 5 / 40 and serving and error == ""
    group.register("r0")
    metrics = ServerMetrics(lambda: group.latest_stats, lambda: 1,
                            lambda: (group.router.in_flight, group.router.routed))
    samples = {(s.name, s.labels.get("replica")): s.value
               for family in text_string_to_metric_families(
                   generate_latest(metrics.registry).decode())
               for s in family.samples}
    assert samples[("jaxserve_num_requests_running", "0")] == 2
    assert samples[("jaxserve_num_requests_running", "1")] == 3
    assert samples[("jaxserve_kv_cache_usage_perc", "1")] == 0.3
    assert samples[("jaxserve_prefix_cache_hit_rate", "0")] == 0.5
    assert samples[("jaxserve_worker_restarts_total", "1")] == 1
    assert samples[("jaxserve_replica_requests_total", "0")] == 1
    assert samples[("jaxserve_replica_requests_in_flight", "0")] == 1
    assert samples[("jaxserve_replica_requests_in_flight", "1")] == 0
    assert samples[("jaxserve_num_sequences_in_flight", None)] == 1


def test_sum_stats_of_one_is_itself():
    one = _stats(kv_blocks_total=7, num_steps=3)
    assert sum_stats([one]) == one
