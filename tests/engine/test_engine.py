"""Engine core on the fake worker: outputs, prefix caching, preemption, n > 1, stops, plans.

The oracle is ``expected_completion``: the fake model's continuation of each
prompt computed alone, with no cache and no engine (tests/engine/fake_worker.py).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_IDS, SamplingParams
from jaxserve.validation import InvalidArgument
from tests.engine.fake_worker import (FakeWorker, expected_completion, reference_prompt_logprobs,
                                      reference_tokens)

EOS = (0,)
MAX_LEN = 200


def _engine(budget=64, num_blocks=400, caching=True, max_num_seqs=16, block_size=4, **sched):
    config = EngineConfig(
        max_model_len=MAX_LEN,
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  **sched),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks,
                          enable_prefix_caching=caching))
    worker = FakeWorker(max_model_len=MAX_LEN, eos_token_ids=EOS)
    return EngineCore(config, worker), worker


def _run(engine, requests, max_steps=20000):
    for rid, prompt, sp in requests:
        engine.add_request(EngineCoreRequest(rid, prompt, sp))
    tokens, finish = {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            key = (out.request_id, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                finish[key] = (out.finish_reason, out.stop_reason, out.num_cached_tokens)
    assert not engine.has_unfinished_requests()
    return tokens, finish


def _random_requests(num, seed):
    rng = random.Random(seed)
    system = [rng.randrange(1, 64) for _ in range(24)]
    out = []
    for i in range(num):
        head = system if i % 2 == 0 else []
        prompt = head + [rng.randrange(1, 64) for _ in range(rng.randrange(1, 40))]
        sp = SamplingParams(n=rng.choice([1, 1, 1, 2]), max_tokens=rng.randrange(1, 24),
                            ignore_eos=rng.random() < 0.3)
        out.append((f"req{i}", prompt, sp))
    return out


def _check_against_reference(requests, tokens, finish):
    for rid, prompt, sp in requests:
        for i in range(sp.n):
            want, reason, stop = expected_completion(prompt, sp, EOS, MAX_LEN)
            assert tokens[(rid, i)] == want, (rid, i)
            assert finish[(rid, i)][:2] == (reason, stop)


@pytest.mark.parametrize("budget,caching,chunked", [
    (64, True, True), (64, False, True), (16, True, True), (2048, True, True), (64, True, False)])
def test_outputs_equal_the_reference(budget, caching, chunked):
    requests = _random_requests(32, seed=1)
    engine, _ = _engine(budget=budget, caching=caching, enable_chunked_prefill=chunked)
    _check_against_reference(requests, *_run(engine, requests))


def test_tiny_cache_preempts_and_outputs_stay_equal():
    requests = _random_requests(32, seed=2)
    big, _ = _engine(num_blocks=1000)
    tiny, _ = _engine(num_blocks=MAX_LEN // 4 + 1)  # one full-length sequence fits, no more
    big_out, tiny_out = _run(big, requests), _run(tiny, requests)
    assert tiny.stats().num_preemptions > 0 and big.stats().num_preemptions == 0
    assert big_out[0] == tiny_out[0]
    _check_against_reference(requests, *tiny_out)


def test_preempted_sequence_returns_as_a_new_row_with_its_generated_tokens():
    engine, worker = _engine(num_blocks=MAX_LEN // 4 + 1, max_num_seqs=4)
    worker.keep_plans = True
    requests = [(f"r{i}", [i + 1] * 30, SamplingParams(max_tokens=40, ignore_eos=True))
                for i in range(4)]
    _run(engine, requests)
    assert engine.stats().num_preemptions > 0
    resumed = [new for plan in worker.plans for new in plan.new_rows
               if len(new.token_ids) > new.num_prompt_tokens]
    assert resumed
    for new in resumed:
        prompt = new.token_ids[:new.num_prompt_tokens].tolist()
        generated = new.token_ids[new.num_prompt_tokens:].tolist()
        assert generated == reference_tokens(prompt, len(generated))


def test_shared_system_prompt_hits_the_prefix_cache():
    rng = random.Random(3)
    system = [rng.randrange(1, 64) for _ in range(64)]  # 4 full blocks of 16
    requests = [(f"r{i}", system + [rng.randrange(1, 64) for _ in range(rng.randrange(1, 30))],
                 SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(20)]
    for budget in (64, 2048):  # also when all requests are admitted in one step
        engine, _ = _engine(budget=budget, block_size=16, num_blocks=200, max_num_seqs=32)
        _, finish = _run(engine, requests)
        hit_blocks = sum(min(finish[(rid, 0)][2], 64) // 16 for rid, _, _ in requests[1:])
        shareable = 4 * (len(requests) - 1)
        assert hit_blocks / shareable >= 0.9, (budget, hit_blocks, shareable)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_arrive_once_whole_through_chunks_preemption_and_cache(
        async_scheduling):
    """Every prompt position once, in sample 0's first output, whatever the schedule.

    Budget 16 chunks the prompts; a cache holding one full-length sequence
    preempts; the shared system prompt is in the prefix cache, yet a request
    asking for prompt logprobs takes no hit. Sample 1 and a resumed sequence
    whose prompt logprobs went out score nothing (the plan strips them).
    """
    rng = random.Random(9)
    system = [rng.randrange(1, 64) for _ in range(32)]
    requests = []
    for i in range(12):
        prompt = system + [rng.randrange(1, 64) for _ in range(rng.randrange(1, 30))]
        asks = i % 3 != 0
        requests.append((f"p{i}", prompt, SamplingParams(
            n=1 + (i % 4 == 1), max_tokens=30, ignore_eos=True,
            prompt_logprobs=i % 3 if asks else None)))
    config = EngineConfig(
        max_model_len=MAX_LEN, async_scheduling=async_scheduling,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16),
        cache=CacheConfig(block_size=4, num_kv_blocks=MAX_LEN // 4 + 1))
    worker = FakeWorker(max_model_len=MAX_LEN, eos_token_ids=EOS)
    worker.keep_plans = True
    engine = EngineCore(config, worker)
    for rid, prompt, sp in requests:
        engine.add_request(EngineCoreRequest(rid, prompt, sp))
    got, cached = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.index == 0 and out.request_id not in got
                got[out.request_id] = [lp.logprob for lp in out.prompt_logprobs]
                cached[out.request_id] = out.num_cached_tokens
    assert engine.stats().num_preemptions > 0
    for rid, prompt, sp in requests:
        if sp.prompt_logprobs is None:
            assert rid not in got
            continue
        assert got[rid] == reference_prompt_logprobs(prompt), rid
        assert cached[rid] == 0
    scoring = [new for plan in worker.plans for new in plan.new_rows
               if new.sampling_params.prompt_logprobs is not None]
    assert all(len(new.token_ids) == new.num_prompt_tokens for new in scoring)


@pytest.mark.parametrize("caching", [True, False])
def test_parallel_samples_share_the_prompt_blocks(caching):
    prompt = list(range(1, 42))  # 41 tokens: 10 full blocks of 4
    engine, worker = _engine(caching=caching, budget=256)
    worker.keep_plans = True
    sp = SamplingParams(n=3, max_tokens=3, ignore_eos=True)
    tokens, finish = _run(engine, [("r", prompt, sp)])
    assert [finish[("r", i)][2] for i in range(3)] == [0, 40, 40]
    assert all(tokens[("r", i)] == reference_tokens(prompt, 3) for i in range(3))
    first_blocks = {tuple(new.block_ids[:10].tolist()) for p in worker.plans for new in p.new_rows}
    assert len(first_blocks) == 1  # all three rows start from the same 10 blocks


def test_stop_conditions():
    prompt = [5, 9, 13]
    ref = reference_tokens(prompt, 30)
    target = ref[4]
    first = ref.index(target)
    engine, _ = _engine()
    requests = [
        ("stop_id", prompt, SamplingParams(max_tokens=30, stop_token_ids=[target], ignore_eos=True)),
        ("min_tokens", prompt, SamplingParams(max_tokens=30, stop_token_ids=[target],
                                              min_tokens=first + 2, ignore_eos=True)),
        ("max_tokens", prompt, SamplingParams(max_tokens=3, ignore_eos=True)),
        ("max_len", prompt, SamplingParams(max_tokens=None, ignore_eos=True)),
        ("eos", prompt, SamplingParams(max_tokens=30, ignore_eos=False)),
    ]
    tokens, finish = _run(engine, requests)
    assert tokens[("stop_id", 0)] == ref[:first + 1]
    assert finish[("stop_id", 0)][:2] == ("stop", target)
    want_min = expected_completion(prompt, requests[1][2], EOS, MAX_LEN)[0]
    assert tokens[("min_tokens", 0)] == want_min and len(want_min) >= first + 2
    assert tokens[("max_tokens", 0)] == ref[:3] and finish[("max_tokens", 0)][0] == "length"
    assert len(prompt) + len(tokens[("max_len", 0)]) == MAX_LEN
    assert finish[("max_len", 0)][0] == "length"
    eos_at = [i for i, t in enumerate(reference_tokens(prompt, 30)) if t in EOS]
    want = ("stop", None) if eos_at else ("length", None)
    assert finish[("eos", 0)][:2] == want


def test_abort_frees_blocks_and_rows_at_any_time():
    engine, _ = _engine(budget=16, max_num_seqs=2)
    for i in range(4):
        engine.add_request(EngineCoreRequest(f"r{i}", [i + 1] * 20,
                                             SamplingParams(max_tokens=50, ignore_eos=True, n=2)))
    engine.step()
    engine.step()
    s = engine.stats()
    assert s.num_running > 0 and s.num_waiting > 0 and s.kv_blocks_used > 0
    engine.abort_requests([("r0", 1), "r3", "unknown"])
    engine.abort_requests(["r0", "r1", "r2"])
    assert not engine.has_unfinished_requests()
    s = engine.stats()
    assert (s.kv_blocks_used, s.num_running, s.num_waiting) == (0, 0, 0)
    assert sorted(engine.scheduler.free_rows) == [0, 1]
    assert engine.step() == []
    # The freed rows reach the worker with the next plan, before any new row.
    tokens, _ = _run(engine, [("again", [3] * 5, SamplingParams(max_tokens=2, ignore_eos=True))])
    assert tokens[("again", 0)] == reference_tokens([3] * 5, 2)


def test_a_sequence_named_twice_in_one_abort_ends_once():
    engine, _ = _engine(budget=16, max_num_seqs=4)
    engine.add_request(EngineCoreRequest("pair", [7, 7, 7], SamplingParams(
        max_tokens=50, ignore_eos=True, n=2)))
    engine.add_request(EngineCoreRequest("solo", [5] * 9, SamplingParams(
        max_tokens=50, ignore_eos=True)))
    for _ in range(3):
        engine.step()
    engine.abort_requests([("pair", 1), ("pair", 1), "solo", ("solo", 0)])
    assert engine.scheduler.groups["pair"].num_unfinished == 1  # sequence 0 still runs
    engine.abort_requests(["pair"])
    assert not engine.has_unfinished_requests()
    s = engine.stats()
    assert (s.kv_blocks_used, s.num_running, s.num_waiting) == (0, 0, 0)
    assert sorted(engine.scheduler.free_rows) == [0, 1, 2, 3]


def test_invalid_requests_are_rejected_naming_the_field():
    engine, _ = _engine(max_num_seqs=4)
    engine.add_request(EngineCoreRequest("a", [1, 2], SamplingParams()))
    prompt, sp = "prompt_token_ids", "sampling_params."
    cases = [
        (EngineCoreRequest("a", [1, 2], SamplingParams()), "request_id"),  # still running
        (EngineCoreRequest("b", [], SamplingParams()), prompt),
        (EngineCoreRequest("c", [1] * MAX_LEN, SamplingParams()), prompt),
        (EngineCoreRequest("d", [1, 64], SamplingParams()), prompt),  # V = 64
        (EngineCoreRequest("e", [1], SamplingParams(stop_token_ids=[64])), sp + "stop_token_ids"),
        (EngineCoreRequest("f", [1], SamplingParams(
            stop_token_ids=list(range(1, MAX_STOP_IDS + 1)))), sp + "stop_token_ids"),  # + EOS
        (EngineCoreRequest("g", [1], SamplingParams(logit_bias={64: 1.0})), sp + "logit_bias"),
        (EngineCoreRequest("h", [1], SamplingParams(
            logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})), sp + "logit_bias"),
        (EngineCoreRequest("i", [1], SamplingParams(n=5)), sp + "n"),
        (EngineCoreRequest("l", [1], SamplingParams(seed=2**64)), sp + "seed"),
    ]
    for request, field in cases:
        with pytest.raises(InvalidArgument) as err:
            engine.add_request(request)
        assert isinstance(err.value, ValueError) and err.value.field == field, request
        assert str(err.value).startswith(field + ": ")
    # Refused requests hold nothing: only "a" is queued.
    assert list(engine.scheduler.groups) == ["a"]
    # The limits themselves are accepted (EOS not counted with ignore_eos).
    engine.add_request(EngineCoreRequest("k", [1], SamplingParams(
        n=4, stop_token_ids=list(range(1, MAX_STOP_IDS + 1)), ignore_eos=True,
        logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)}, prompt_logprobs=MAX_LOGPROBS)))


def test_decode_plans_are_o_rows_and_buckets_are_on_the_ladder():
    engine, worker = _engine(budget=64, max_num_seqs=16, block_size=4)
    worker.keep_plans = True
    requests = [(f"r{i}", [i + 1] * 9, SamplingParams(max_tokens=20, ignore_eos=True))
                for i in range(16)]
    _run(engine, requests)
    ladder_t = engine.config.scheduler.token_buckets
    ladder_r = engine.config.scheduler.request_buckets
    decode = [p for p in worker.plans if not p.new_rows and p.total_tokens == len(p.rows) == 16]
    assert decode
    for plan in decode:
        assert plan.num_tokens_bucket == 16 and plan.num_reqs_bucket == 16
        assert len(plan.append_block_ids) <= len(plan.rows)  # at most one new block per row
        sizes = [a.size for a in (plan.freed_rows, plan.append_rows, plan.append_block_ids,
                                  plan.rows, plan.num_computed, plan.num_tokens, plan.sample)]
        assert max(sizes) <= 16
    assert {p.num_tokens_bucket for p in worker.plans} <= set(ladder_t)
    assert {p.num_reqs_bucket for p in worker.plans} <= set(ladder_r) | {0}


def test_many_random_requests_only_reach_ladder_buckets():
    rng = random.Random(4)
    engine, worker = _engine(budget=96, max_num_seqs=24, num_blocks=300,
                             token_buckets=(1, 4, 8, 16, 32, 96), request_buckets=(1, 4, 8, 24))
    requests = [(f"r{i}", [rng.randrange(1, 64) for _ in range(rng.randrange(1, 120))],
                 SamplingParams(max_tokens=rng.randrange(1, 16), n=rng.choice([1, 1, 2])))
                for i in range(500)]
    _check_against_reference(requests, *_run(engine, requests))
    seen = set(worker.buckets)
    assert {t for t, _ in seen} <= {1, 4, 8, 16, 32, 96}
    assert {r for _, r in seen} <= {0, 1, 4, 8, 24}
    assert np.mean([t for t, _ in worker.buckets]) > 1
