"""The engine service (``EngineServer`` + the api's ``EngineClient``) over loopback gRPC.

The engine core runs on ``FakeWorker`` (jax-free, exact): requests sent
through the service produce the same tokens and finish reasons as the same
requests run directly on an ``EngineCore``; aborts and a closed output
stream free every block; a worker that dies fails every in-flight request
with its error, and the engine then reports NOT_SERVING and refuses work;
with a restart function the engine serves again on a new worker, and the
client reopens its stream and serves again.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.api.engine_client import EngineClient, EngineError, EngineFailure
from jaxserve.engine import (CacheConfig, EngineConfig, EngineCore, EngineCoreRequest,
                             SchedulerConfig)
from jaxserve.engine.service import SERVICE_NAME, EngineServer
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import WorkerDiedError
from tests.engine.fake_worker import FakeWorker

VOCAB = 64


def _core(worker: FakeWorker | None = None) -> EngineCore:
    config = EngineConfig(max_model_len=64,
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
                          cache=CacheConfig(block_size=4, num_kv_blocks=64))
    return EngineCore(config, worker or FakeWorker(vocab_size=VOCAB))


def _requests(seed: int, count: int) -> list[EngineCoreRequest]:
    rng = random.Random(seed)
    return [EngineCoreRequest(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 12))],
                              SamplingParams(max_tokens=rng.randint(1, 12), n=rng.choice([1, 1, 2]),
                                             ignore_eos=rng.random() < 0.5))
            for i in range(count)]


def _direct(requests: list[EngineCoreRequest]) -> dict[tuple[str, int], tuple]:
    """(request id, index) -> (tokens, finish reason, stop reason) on a plain EngineCore."""
    core = _core()
    for r in requests:
        core.add_request(r)
    out: dict[tuple[str, int], tuple] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            tokens, _, _ = out.get((o.request_id, o.index), ((), None, None))
            out[(o.request_id, o.index)] = (tokens + tuple(o.new_token_ids), o.finish_reason,
                                            o.stop_reason)
    return out


class _Served:
    """An EngineServer on a free port with a connected EngineClient (use inside asyncio)."""

    def __init__(self, core: EngineCore, **server_kwargs):
        self.server = EngineServer(core, "127.0.0.1:0", **server_kwargs)
        self.address = f"127.0.0.1:{self.server.port}"

    async def __aenter__(self):
        self.server.start()
        self.client = EngineClient(self.address)
        await self.client.connect(timeout=30)
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        self.server.stop(grace=0.5)


async def _collect(client: EngineClient, request: EngineCoreRequest, queue) -> dict:
    out, unfinished = {}, request.sampling_params.n
    while unfinished:
        item = await asyncio.wait_for(queue.get(), 30)
        if isinstance(item, EngineFailure):
            return {"failure": item.message}
        tokens, _, _ = out.get((item.request_id, item.index), ((), None, None))
        out[(item.request_id, item.index)] = (tokens + tuple(item.new_token_ids),
                                              item.finish_reason, item.stop_reason)
        unfinished -= item.finish_reason is not None
    client.unregister(request.request_id)
    return out


def test_outputs_through_the_service_equal_a_direct_engine_core():
    requests = _requests(seed=3, count=12)
    want = _direct(requests)

    async def run():
        async with _Served(_core()) as served:
            queues = [served.client.register(r.request_id) for r in requests]
            for r in requests:
                await served.client.add(r)
            results = await asyncio.gather(*(_collect(served.client, r, q)
                                             for r, q in zip(requests, queues)))
            stats, serving, error = await served.client.stats()
            return results, stats, serving, error

    results, stats, serving, error = asyncio.run(run())
    got = {k: v for r in results for k, v in r.items()}
    assert got == want
    assert serving and not error
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


class _SlowWorker(FakeWorker):
    """20 ms per step, so requests are still running when the test looks."""

    def execute(self, plan):
        time.sleep(0.02)
        return super().execute(plan)


def test_abort_and_closed_stream_free_every_block():
    long = SamplingParams(max_tokens=40, ignore_eos=True)

    async def run():
        core = _core(_SlowWorker(vocab_size=VOCAB))
        async with _Served(core) as served:
            c = served.client
            queue = c.register("a")
            await c.add(EngineCoreRequest("a", [5, 6, 7], long))
            await asyncio.wait_for(queue.get(), 30)
            assert (await c.stats())[0].kv_blocks_used > 0
            await c.abort(["a"])
            assert (await c.stats())[0].kv_blocks_used == 0
            # A second api connection whose stream closes takes its requests with it.
            other = EngineClient(served.address)
            await other.connect(timeout=30)
            queue = other.register("b")
            await other.add(EngineCoreRequest("b", [1, 2], SamplingParams(n=2, max_tokens=40,
                                                                          ignore_eos=True)))
            await asyncio.wait_for(queue.get(), 30)
            assert (await c.stats())[0].kv_blocks_used > 0
            await other.close()
            for _ in range(100):
                stats = (await c.stats())[0]
                if stats.kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.05)
            return stats

    stats = asyncio.run(run())
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_refused_requests_get_their_status():
    async def run():
        async with _Served(_core()) as served:
            c = served.client
            codes = []
            for request in (EngineCoreRequest("x", [VOCAB], SamplingParams()),
                            EngineCoreRequest("y", [1], SamplingParams(n=99))):
                c.register(request.request_id)
                with pytest.raises(EngineError) as err:
                    await c.add(request)
                codes.append(err.value.code)
            return codes

    assert asyncio.run(run()) == [grpc.StatusCode.INVALID_ARGUMENT] * 2


class _DyingWorker(_SlowWorker):
    """Dies (as GrpcWorker reports a lost worker) at the first step after ``armed`` is set."""

    def __init__(self):
        super().__init__(vocab_size=VOCAB)
        self.armed = threading.Event()

    def execute(self, plan):
        if self.armed.is_set():
            raise WorkerDiedError("the worker at 127.0.0.1:1 died: Execute failed: UNAVAILABLE")
        return super().execute(plan)


def _long_requests(count: int) -> list[EngineCoreRequest]:
    """Requests of 60 tokens each (max_model_len 64), in flight when the worker dies."""
    return [EngineCoreRequest(f"d{i}", [i + 1, 2, 3], SamplingParams(max_tokens=60,
                                                                      ignore_eos=True))
            for i in range(count)]


async def _run_until_worker_dies(client: EngineClient, worker: _DyingWorker,
                                 requests: list[EngineCoreRequest]) -> list[dict]:
    """Sends ``requests``, arms ``worker`` to die, and collects each request's outcome."""
    queues = [client.register(r.request_id) for r in requests]
    for r in requests:
        await client.add(r)
    worker.armed.set()
    return await asyncio.gather(*(_collect(client, r, q) for r, q in zip(requests, queues)))


def _health_status(address: str):
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10).status


def test_worker_death_fails_in_flight_requests_and_stops_serving():
    requests = _long_requests(6)
    failures = []

    async def run():
        worker = _DyingWorker()
        async with _Served(_core(worker)) as served:
            c = served.client
            c.on_failure(failures.append)
            results = await _run_until_worker_dies(c, worker, requests)
            stats, serving, error = await c.stats()
            c.register("late")
            with pytest.raises(EngineError) as err:
                await c.add(EngineCoreRequest("late", [1], SamplingParams()))
            status = _health_status(served.address)
            return results, serving, error, err.value.code, status, c.serving

    results, serving, error, late_code, status, client_serving = asyncio.run(run())
    assert all("failure" in r and "worker" in r["failure"] and "died" in r["failure"]
               for r in results), results
    assert not serving and "WorkerDiedError" in error
    assert late_code == grpc.StatusCode.UNAVAILABLE
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert not client_serving and len(failures) == 1


def test_after_worker_death_the_engine_restarts_and_the_client_serves_again():
    doomed = _long_requests(4)
    after = _requests(seed=11, count=3)
    replaced = []

    def restart(old: EngineCore) -> EngineCore:
        replaced.append(old)
        return _core()

    async def run():
        worker = _DyingWorker()
        async with _Served(_core(worker), restart=restart, max_restarts=3) as served:
            c = served.client
            recovered = asyncio.Event()
            c.on_recovery(recovered.set)
            failed = await _run_until_worker_dies(c, worker, doomed)
            await asyncio.wait_for(recovered.wait(), 30)
            status = _health_status(served.address)
            queues = [c.register(r.request_id) for r in after]
            for r in after:
                await c.add(r)
            results = await asyncio.gather(*(_collect(c, r, q) for r, q in zip(after, queues)))
            stats, serving, error = await c.stats()
            return failed, status, results, stats, serving, error, c.serving

    failed, status, results, stats, serving, error, client_serving = asyncio.run(run())
    assert all("failure" in r and "died" in r["failure"] for r in failed), failed
    assert status == health_pb2.HealthCheckResponse.SERVING
    merged = {k: v for r in results for k, v in r.items()}
    assert merged == _direct(after)
    assert len(replaced) == 1 and not replaced[0].serving
    assert serving and not error and client_serving
    assert stats.num_worker_restarts == 1
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
