"""The worker behind gRPC: same outputs as in process, errors, health, process life cycle.

Oracle: the engine on an ``InProcessWorker`` over the same tiny random-weight
Llama (tests/model/hf_tiny.py), synchronous. The gRPC worker (served on a
thread of this process, or as its own process) must return bit-identical
tokens and logprobs for the same configuration, and the same tokens with
logprobs within 1e-5 (float32 sums batched differently) with async
scheduling and a cache small enough to preempt. Requests are greedy or
seeded, whose draws depend only on (seed, position), not on step ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import random
import signal
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine import scheduler as scheduler_module
from jaxserve.engine.config import CompileConfig, SpeculativeConfig
from jaxserve.engine.grpc_worker import GrpcWorker, start_worker_process
from jaxserve.model.loader import load_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import NewRow, StepPlan
from jaxserve.worker import InProcessWorker, server
from jaxserve.worker.executables import BACKGROUND_VARIANTS
from jaxserve.worker.sampler import COMPILED_VARIANTS
from tests.model.hf_tiny import make_tiny_model
from tests.worker.speculative_oracle import OracleProposer

VOCAB = 256
T_LADDER, R_LADDER = (1, 4, 8, 16, 32), (1, 2, 4, 8)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_grpc")
    make_tiny_model("LlamaForCausalLM", directory, seed=3)
    return str(directory)


@contextlib.contextmanager
def thread_server():
    """``jaxserve.worker.server.serve`` on a thread of this process; yields its address."""
    bound: queue.Queue[str] = queue.Queue()
    thread = threading.Thread(target=server.serve, args=("127.0.0.1:0",),
                              kwargs=dict(announce=bound.put), daemon=True)
    thread.start()
    address = bound.get(timeout=120)
    try:
        yield address
    finally:
        GrpcWorker(address).shutdown()
        thread.join(30)
        assert not thread.is_alive()


def _config(model, async_scheduling=False, num_blocks=60):
    return EngineConfig(
        model=model, max_model_len=128, seed=11, async_scheduling=async_scheduling,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                  token_buckets=T_LADDER, request_buckets=R_LADDER),
        cache=CacheConfig(block_size=4, num_kv_blocks=num_blocks),
        compile=CompileConfig(strict_recompile=True))


def _requests(seed, num=24):
    rng = random.Random(seed)
    out = []
    for i in range(num):
        sp = SamplingParams(
            n=rng.choice([1, 1, 2]), temperature=rng.choice([0.0, 0.8]), seed=1000 + i,
            top_k=rng.choice([0, 20]), max_tokens=rng.randrange(1, 16),
            logprobs=rng.choice([None, 0, 3]), repetition_penalty=rng.choice([1.0, 1.4]),
            stop_token_ids=[rng.randrange(VOCAB)], ignore_eos=True)
        out.append((f"q{i}", [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 60))], sp))
    return out


def _run(engine, requests):
    for rid, prompt, sp in requests:
        engine.add_request(EngineCoreRequest(rid, prompt, sp))
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs, _ = got.setdefault((out.request_id, out.index), ([], [], []))
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.new_logprobs or [])
            if out.finished:
                got[(out.request_id, out.index)][2].append(out.finish_reason)
    return got


def test_grpc_worker_matches_the_in_process_worker(tiny_dir, monkeypatch):
    requests = _requests(5)
    first = EngineCore(_config(tiny_dir), InProcessWorker(load_model(tiny_dir), progress=False))
    reference = _run(first, requests)
    first.shutdown()  # its background compiles end here, not beside the next worker's
    assert sum(len(t) for t, _, _ in reference.values()) > 100
    with thread_server() as address:
        worker = GrpcWorker(address)
        engine = EngineCore(_config(tiny_dir), worker)
        assert _run(engine, requests) == reference  # logprobs compare exactly, as floats
        assert worker.wire.plans == engine.num_steps
        worker = GrpcWorker(address)
        engine = EngineCore(_config(tiny_dir, async_scheduling=True, num_blocks=40), worker)
        got = _run(engine, requests)
        assert engine.stats().num_preemptions > 0  # the smaller cache preempts
        assert worker.status().num_recompiles == 0
        assert got.keys() == reference.keys()
        for key, (tokens, logprobs, reasons) in reference.items():
            assert got[key][0] == tokens and got[key][2] == reasons, key
            for a, b in zip(got[key][1], logprobs, strict=True):
                assert a.rank == b.rank and a.top_token_ids == b.top_token_ids, key
                # Preempted rows are recomputed in other T buckets, whose products sum in
                # another order: float32 rounding, a few parts per million.
                np.testing.assert_allclose([a.logprob, *a.top_logprobs],
                                           [b.logprob, *b.top_logprobs], rtol=1e-5, atol=1e-5)
        # Speculative decoding over the wire: drafts in the plans, num_accepted back.
        monkeypatch.setattr(scheduler_module, "propose_ngram", OracleProposer(
            [prompt + reference[(rid, i)][0] for rid, prompt, sp in requests
             for i in range(sp.n)], VOCAB))
        spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                 prompt_lookup_max=2)
        engine = EngineCore(dataclasses.replace(_config(tiny_dir), speculative_config=spec),
                            GrpcWorker(address))
        got = _run(engine, requests)
        assert engine.stats().spec_decode_num_accepted_tokens > 0
        _assert_matches(got, reference)
        # A draft model (the model drafting for itself): its proposals come back in
        # StepResult.draft_token_ids, the worker loads it from its directory.
        spec = SpeculativeConfig(method="draft_model", model=str(tiny_dir),
                                 num_speculative_tokens=2)
        engine = EngineCore(dataclasses.replace(_config(tiny_dir), speculative_config=spec),
                            GrpcWorker(address))
        got = _run(engine, requests)
        _assert_matches(got, reference)
        # (greedy drafts: a sampled or penalized row rejects many)
        assert engine.stats().spec_decode_num_accepted_tokens > 0


def _assert_matches(got, reference) -> None:
    for key, (tokens, logprobs, reasons) in reference.items():
        assert got[key][0] == tokens and got[key][2] == reasons, key
        for a, b in zip(got[key][1], logprobs, strict=True):
            np.testing.assert_allclose([a.logprob, *a.top_logprobs],
                                       [b.logprob, *b.top_logprobs], rtol=1e-5, atol=1e-5)


def test_status_health_errors_profile_and_reinitialize(tiny_dir, tmp_path):
    with thread_server() as address:
        worker = GrpcWorker(address)
        assert not worker.status().ready
        i32 = lambda xs: np.array(xs, np.int32)  # noqa: E731
        plan = StepPlan(0, i32([]), (NewRow(0, i32([5, 6, 7]), 3, SamplingParams(), None,
                                            i32([1])),), i32([]), i32([]), i32([0]), i32([0]),
                        i32([3]), np.array([True]), 4, 1)
        with pytest.raises(RuntimeError, match="not initialized"):
            worker.execute(plan)
        channel = grpc.insecure_channel(address)
        check = health_pb2_grpc.HealthStub(channel).Check
        request = health_pb2.HealthCheckRequest(service=server.SERVICE_NAME)
        assert check(request).status == health_pb2.HealthCheckResponse.NOT_SERVING
        engine = EngineCore(_config(tiny_dir), worker)
        assert check(request).status == health_pb2.HealthCheckResponse.SERVING
        status = worker.status()
        assert status.ready and status.platform == "cpu" and status.num_recompiles == 0
        # Before ready: |T| bodies, |R| x the variants not compiled in the background,
        # |R| staged row writes, set_penalty_row
        eager = len(COMPILED_VARIANTS) - len(BACKGROUND_VARIANTS)
        assert status.num_executables == (len(T_LADDER) + eager * len(R_LADDER)
                                          + len(R_LADDER) + 1)
        with pytest.raises(ValueError, match="not on the ladders"):
            worker.execute(StepPlan(**{**{f: getattr(plan, f) for f in plan.__slots__},
                                       "num_tokens_bucket": 3}))
        assert not worker.dead  # a refused plan is not a death
        got = _run(engine, _requests(6, num=4))
        assert all(reasons for _, _, reasons in got.values())
        # A second engine re-initializes the same process (fresh rows and cache),
        # under the profiler.
        engine = EngineCore(_config(tiny_dir, async_scheduling=True), worker)
        worker.start_profile(str(tmp_path))
        assert _run(engine, _requests(6, num=4)) == got
        worker.stop_profile()
        assert list(tmp_path.rglob("*.xplane.pb"))  # a trace TensorBoard / Perfetto can read
        assert worker.status().num_steps == engine.num_steps + (engine._in_flight is not None)
        channel.close()


def test_plans_run_in_step_order_whatever_order_they_arrive_in(tiny_dir):
    """Step 1 decodes the token step 0 samples: sent first, it must wait for step 0."""
    i32 = lambda xs: np.array(xs, np.int32)  # noqa: E731
    prompt = i32([9, 8, 7, 6, 5])
    plans = [
        StepPlan(0, i32([]), (NewRow(2, prompt, 5, SamplingParams(temperature=0.0), None,
                                     i32([1, 2])),), i32([]), i32([]), i32([2]), i32([0]),
                 i32([5]), np.array([True]), 8, 1),
        StepPlan(1, i32([]), (), i32([]), i32([]), i32([2]), i32([5]), i32([1]),
                 np.array([True]), 1, 1),
    ]
    init = _config(tiny_dir).worker_init()
    local = InProcessWorker(load_model(tiny_dir), progress=False)
    local.initialize(init)
    want = [local.execute(p).token_ids.tolist() for p in plans]
    with thread_server() as address:
        worker = GrpcWorker(address)
        worker.initialize(init)
        second = worker.submit(plans[1])
        time.sleep(0.3)
        assert not second.done()  # waiting for step 0
        first = worker.submit(plans[0])
        assert [first.result(30).token_ids.tolist(), second.result(30).token_ids.tolist()] == want


def test_worker_process_exits_on_shutdown_and_on_sigterm():
    worker = start_worker_process(log_level="WARNING")
    assert not worker.status().ready
    worker.shutdown()  # the Shutdown call; waits for the process
    assert worker.process.returncode == 0
    worker = start_worker_process(log_level="WARNING")
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(timeout=30) == 0
