"""The load generator against a paced fake GenerateService: metrics, concurrency, arrivals."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
import numpy as np
import pytest

from benchmarks.dataset import fixed_lengths
from benchmarks.load_generator import arrival_offsets, run_load, summarize
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto import generate_pb2_grpc as pb_grpc

FIRST_S, TOKEN_S = 0.05, 0.02  # the fake's delay before the first token, and between tokens


class PacedServicer(pb_grpc.GenerateServiceServicer):
    """Streams max_tokens tokens, one per TOKEN_S after FIRST_S; counts calls in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.prompts: list[list[int]] = []
        self.cap: int | None = None  # when set, streams at most this many tokens

    def Generate(self, request, context):
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.prompts.append(list(request.token_ids.ids))
        try:
            n = request.sampling_params.max_tokens
            n = n if self.cap is None else min(n, self.cap)
            time.sleep(FIRST_S)
            for k in range(n):
                if k:
                    time.sleep(TOKEN_S)
                yield pb.GenerateResponse(request_id="r", token_ids=[7], text="x")
            yield pb.GenerateResponse(request_id="r", finished=pb.Finished(
                reason=pb.FINISH_REASON_LENGTH, prompt_tokens=len(request.token_ids.ids),
                completion_tokens=n))
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.fixture()
def paced():
    servicer = PacedServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_GenerateServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()  # clients wait for SERVING, as from a real server
    health_servicer.set("jaxserve.GenerateService", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None).wait()


def test_metrics_of_a_paced_server(paced):
    servicer, target = paced
    workload = fixed_lengths(6, 1000, 5, 6, seed=2)
    records, duration = asyncio.run(run_load(target, workload, max_concurrency=2))
    assert servicer.max_in_flight == 2
    assert sorted(map(tuple, servicer.prompts)) == sorted(workload.prompts)
    m = summarize(records, duration)
    assert m["completed"] == 6 and m["failed"] == 0 and m["output_tokens"] == 36
    # 3 waves of 2: each request takes FIRST_S + 5 * TOKEN_S = 0.15 s. The fake's sleeps
    # only overshoot, by more on a loaded machine (the suite runs two test processes), so
    # the bounds are tight below (units and definitions) and loose above.
    assert 0.45 <= duration < 0.45 + 0.5
    assert m["output_throughput"] == pytest.approx(36 / duration)
    assert 1e3 * FIRST_S - 5 <= m["ttft_ms"]["p50"] <= 1e3 * FIRST_S + 60
    assert 1e3 * TOKEN_S - 5 <= m["tpot_ms"]["p50"] <= 1e3 * TOKEN_S + 25
    assert 1e3 * TOKEN_S - 5 <= m["itl_ms"]["p50"] <= 1e3 * TOKEN_S + 25
    e2e = 1e3 * (FIRST_S + 5 * TOKEN_S)
    assert e2e - 5 <= m["e2e_ms"]["p50"] <= e2e + 80
    for r in records:  # TPOT's definition, per request
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / 5)
        assert len(r.itl) == 5 and r.output_tokens == 6


def test_poisson_rate_spreads_the_sends(paced):
    _, target = paced
    workload = fixed_lengths(5, 1000, 4, 1, seed=3)
    start = time.perf_counter()
    records, _ = asyncio.run(run_load(target, workload, request_rate=20.0, seed=5))
    sends = np.array([r.send for r in records]) - start
    offsets = arrival_offsets(5, 20.0, 5)
    # each request goes out at its Poisson offset (plus the connection set-up before the first)
    np.testing.assert_allclose(sends - sends[0], offsets - offsets[0], atol=0.03)


def test_short_streams_are_errors(paced):
    servicer, target = paced
    workload = fixed_lengths(2, 1000, 3, 4, seed=0)
    servicer.cap = 1  # ignores max_tokens: one token, then done
    records, duration = asyncio.run(run_load(target, workload))
    m = summarize(records, duration)
    assert m["failed"] == 2 and "asked for 4" in m["errors"][0]


def test_arrival_offsets():
    gaps = np.diff(arrival_offsets(4000, 5.0, seed=1))
    assert gaps.min() > 0
    assert gaps.mean() == pytest.approx(0.2, rel=0.06)  # exponential: mean 1/rate
    assert gaps.std() == pytest.approx(0.2, rel=0.1)  # and std 1/rate
    assert not arrival_offsets(3, math.inf, seed=0).any()
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, seed=0)
