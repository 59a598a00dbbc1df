"""The plan codec (jaxserve.plan_codec): exact round trips and O(rows) decode plans.

Oracles: the original dataclasses (field-by-field equality after a trip
through serialized protobuf bytes) and the sizes of the arrays themselves
(a decode plan is a few bytes per scheduled row, whatever the context
length). Plans come from the real engine (scheduler + plan builder) driving
the fake worker, and from random draws.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from jaxserve import plan_codec
from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.proto import worker_pb2 as wpb
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import (NewRow, PromptLogprobs, StepPlan, StepResult, WorkerInit,
                                WorkerStatus)
from tests.engine.fake_worker import FakeWorker


def _wire(msg, cls):
    return cls.FromString(msg.SerializeToString())


def _assert_same(a, b):
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f.name
        elif isinstance(x, PromptLogprobs):
            _assert_same(x, y)
        elif isinstance(x, tuple) and x and isinstance(x[0], NewRow):
            assert len(x) == len(y)
            for u, v in zip(x, y):
                _assert_same(u, v)
        else:
            assert x == y, f.name


def _random_params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.3:
        return SamplingParams(temperature=rng.choice([0.0, 1.0]), structured_outputs=rng.choice([
            {"json": {"type": "object", "properties": {"é": {"type": "integer"}}}},
            {"regex": "[a-z]+"}, {"choice": ["yes", "no"]}, {"json_object": True},
            {"grammar": 'start: "a"+'}]))
    return SamplingParams(
        n=1, temperature=rng.choice([0.0, 0.7, 1.3]), top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 5]), min_p=rng.choice([0.0, 0.05]), seed=rng.choice([None, 3, -7,
                                                                                    2**70 + 5]),
        repetition_penalty=rng.choice([1.0, 1.2]), presence_penalty=rng.uniform(-2, 2),
        frequency_penalty=rng.uniform(-2, 2), max_tokens=rng.choice([None, 9]),
        min_tokens=rng.choice([0, 2]), stop=rng.choice([None, ["\n\n", "é"]]),
        stop_token_ids=rng.choice([None, [2, 7]]), ignore_eos=rng.random() < 0.5,
        logprobs=rng.choice([None, 0, 5]), logit_bias=rng.choice([None, {3: -1.5, 11: 2.25}]))


def _random_plan(rng: random.Random, step_id: int) -> StepPlan:
    i32 = lambda xs: np.array(xs, np.int32)  # noqa: E731
    n = rng.randrange(0, 12)
    new_rows = tuple(
        NewRow(row=rng.randrange(64), token_ids=i32([rng.randrange(50000) for _ in range(p)]),
               num_prompt_tokens=rng.randrange(1, p + 1), sampling_params=_random_params(rng),
               seed=rng.choice([None, rng.randrange(-2**70, 2**70)]),
               block_ids=i32([rng.randrange(1, 9999) for _ in range(rng.randrange(0, 5))]))
        for p in (rng.randrange(1, 40) for _ in range(rng.randrange(0, 3))))
    a = rng.randrange(0, 5)
    sample = np.array([rng.random() < 0.5 for _ in range(n)], np.bool_)
    mask = None
    if sample.any() and rng.random() < 0.4:
        mask = np.array([[rng.randrange(-2**31, 2**31) for _ in range(7)]
                         for _ in range(int(sample.sum()))], np.int32)
    return StepPlan(
        step_id=step_id, freed_rows=i32(rng.sample(range(64), rng.randrange(0, 4))),
        new_rows=new_rows, append_rows=i32([rng.randrange(64) for _ in range(a)]),
        append_block_ids=i32([rng.randrange(1, 9999) for _ in range(a)]),
        rows=i32(rng.sample(range(64), n)), num_computed=i32([rng.randrange(2**20) for _ in range(n)]),
        num_tokens=i32([rng.randrange(1, 512) for _ in range(n)]),
        sample=sample, num_tokens_bucket=rng.choice([1, 4, 512]),
        num_reqs_bucket=rng.choice([0, 8, 256]), token_bitmask=mask)


def test_random_plans_round_trip_exactly():
    rng = random.Random(0)
    for step in range(200):
        plan = _random_plan(rng, step * 977)
        back = plan_codec.plan_from_proto(_wire(plan_codec.plan_to_proto(plan), wpb.StepPlan))
        _assert_same(plan, back)


@pytest.mark.parametrize("with_drafts", [False, True])
@pytest.mark.parametrize("with_prompt", [False, True])
@pytest.mark.parametrize("with_logprobs", [False, True])
def test_results_round_trip_exactly(with_logprobs, with_prompt, with_drafts):
    rng = np.random.default_rng(1)
    s = 7
    result = StepResult(3, rng.integers(0, 50000, s, dtype=np.int32),
                        execute_seconds=0.125, device_seconds=0.0625)
    if with_drafts:  # 4 sampling rows (one with 3 drafts), a draft model's k = 5
        result = dataclasses.replace(
            result, num_accepted=np.array([2, 0, 0, 0], np.int32),
            draft_token_ids=rng.integers(0, 50000, (4, 5), dtype=np.int32))
    if with_logprobs:
        top_ids = rng.integers(-1, 50000, (s, 20), dtype=np.int32)
        result = dataclasses.replace(
            result, logprob=rng.normal(size=s).astype(np.float32),
            rank=rng.integers(1, 9, s, dtype=np.int32), top_token_ids=top_ids,
            top_logprobs=np.where(top_ids >= 0, rng.normal(size=(s, 20)), -np.inf).astype(
                np.float32))
    if with_prompt:  # 5 prompt tokens scored, N up to 3
        top_ids = rng.integers(-1, 50000, (5, 20), dtype=np.int32)
        result = dataclasses.replace(result, prompt_logprobs=PromptLogprobs(
            np.array([0, 0, 0, 2, 2], np.int32), np.array([1, 2, 3, 9, 10], np.int32),
            rng.normal(size=5).astype(np.float32), rng.integers(1, 9, 5, dtype=np.int32),
            top_ids, np.where(top_ids >= 0, rng.normal(size=(5, 20)), -np.inf).astype(
                np.float32)))
    back = plan_codec.result_from_proto(_wire(plan_codec.result_to_proto(result), wpb.StepResult))
    _assert_same(result, back)


def test_init_geometry_and_status_round_trip():
    init = WorkerInit(model="/m", dtype="float32", block_size=16, num_kv_blocks=None,
                      kv_cache_bytes=3 << 30, max_num_seqs=64, max_model_len=None,
                      token_buckets=(1, 4, 8), request_buckets=(1, 2, 64),
                      attention_backend="reference", seed=2**65 + 1, memory_utilization=0.5,
                      precompile=False, strict_recompile=True, compilation_cache_dir="/c",
                      scan_layers=True, quantization="int8", draft_model="/d",
                      num_speculative_tokens=4, kv_cache_dtype="fp8")
    _assert_same(init, plan_codec.init_from_proto(_wire(plan_codec.init_to_proto(init),
                                                        wpb.InitializeRequest)))
    bare = dataclasses.replace(init, model=None, kv_cache_bytes=None, num_kv_blocks=9,
                               max_model_len=128, attention_backend=None,
                               compilation_cache_dir=None, scan_layers=False, quantization=None,
                               draft_model=None, num_speculative_tokens=0,
                               kv_cache_dtype="auto")
    _assert_same(bare, plan_codec.init_from_proto(_wire(plan_codec.init_to_proto(bare),
                                                        wpb.InitializeRequest)))
    status = WorkerStatus(True, "cpu", 22, 3.5, 20, 1, 99)
    assert plan_codec.status_from_proto(_wire(plan_codec.status_to_proto(status),
                                              wpb.WorkerStatus)) == status


def test_malformed_arrays_are_refused():
    msg = plan_codec.plan_to_proto(_random_plan(random.Random(2), 0))
    msg.rows = msg.rows + b"\x01"  # not a whole number of int32s
    with pytest.raises(ValueError, match="rows"):
        plan_codec.plan_from_proto(msg)


def _decode_plan_bytes(num_rows: int, prompt_len: int) -> tuple[int, StepPlan]:
    """Bytes of a pure decode step's plan with ``num_rows`` running sequences."""
    worker = FakeWorker(num_kv_blocks=num_rows * (prompt_len // 16 + 3) + 1,
                        max_model_len=prompt_len + 64, vocab_size=64)
    worker.keep_plans = True
    config = EngineConfig(
        max_model_len=prompt_len + 64,
        scheduler=SchedulerConfig(max_num_seqs=num_rows,
                                  max_num_batched_tokens=num_rows * prompt_len),
        cache=CacheConfig(block_size=16, enable_prefix_caching=False))
    engine = EngineCore(config, worker)
    for i in range(num_rows):
        engine.add_request(EngineCoreRequest(f"r{i}", [1 + i % 50] * prompt_len, SamplingParams(
            max_tokens=20, ignore_eos=True)))
    for _ in range(4):  # a prefill, a decode that appends blocks, two plain decodes
        engine.step()
    plan = worker.plans[-1]
    assert not plan.new_rows and not len(plan.append_rows) and len(plan.rows) == num_rows
    return plan_codec.plan_to_proto(plan).ByteSize(), plan


def test_decode_plan_bytes_grow_with_rows_not_with_blocks():
    sizes = {}
    for rows in (8, 64, 256):
        short, _ = _decode_plan_bytes(rows, prompt_len=16)
        long_, plan = _decode_plan_bytes(rows, prompt_len=500)  # 32 blocks per row
        assert plan.total_tokens == rows and plan.num_sampled == rows
        assert long_ - short <= 4 * rows  # varint step ids etc. aside, no per-block term
        sizes[rows] = long_
    # 13 bytes per row (three i32 arrays and one u8 array) plus a small constant.
    for rows, size in sizes.items():
        assert 13 * rows <= size <= 13 * rows + 64, (rows, size)
