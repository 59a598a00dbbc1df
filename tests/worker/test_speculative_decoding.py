"""Speculative decoding through the engine and the in-process worker, on a tiny random Llama.

Oracle: the same engine without speculation. Verifying drafts must not change
a single token (greedy, seeded random, penalties, min_tokens bans, stop ids,
``n > 1``), nor the logprobs beyond float32 noise (1e-4), however many drafts
are accepted — with drafts from an oracle proposer that copies the reference
output (a wrong token at every third proposal, so rejections are exercised
too) and from the real n-gram proposer, across preemption and prefix caching.
Every run is compiled ahead and strict: a compile after warm-up fails it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve.engine import (CacheConfig, EngineConfig, EngineCore, SchedulerConfig,
                             SpeculativeConfig)
from jaxserve.engine import scheduler as scheduler_module
from jaxserve.engine.config import CompileConfig
from jaxserve.model.loader import load_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker import InProcessWorker
from tests.model.hf_tiny import make_tiny_model
from tests.worker.engine_runs import run_engine, tracked
from tests.worker.speculative_oracle import OracleProposer

VOCAB = 256
MAX_LEN = 128
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model("LlamaForCausalLM", directory, seed=7)
    return load_model(directory, "float32")


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A one-layer random Llama with the target's vocabulary: a draft model that
    disagrees with the target often (rejections exercised)."""
    directory = tmp_path_factory.mktemp("tiny_draft")
    make_tiny_model("LlamaForCausalLM", directory, seed=8, num_hidden_layers=1)
    return directory, load_model(directory, "float32")


def _engine(loaded, spec=None, num_blocks=200, budget=32, draft=None):
    config = EngineConfig(
        max_model_len=MAX_LEN, seed=5, speculative_config=spec,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
        cache=CacheConfig(block_size=4, num_kv_blocks=num_blocks),
        compile=CompileConfig(strict_recompile=True))
    return tracked(EngineCore(config, InProcessWorker(loaded, draft_loaded=draft,
                                                      progress=False)))


def _draft_spec(directory, k=3):
    return SpeculativeConfig(method="draft_model", model=str(directory),
                             num_speculative_tokens=k)


def _prompts(seed, num):
    """Prompts that repeat a few random segments (something for n-grams to find)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        segments = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 6))]
                    for _ in range(3)]
        out.append([t for _ in range(3) for s in rng.sample(segments, 3) for t in s][:40])
    return out


def _requests():
    prompts = _prompts(3, 8)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    return [
        ("greedy0", prompts[0], greedy), ("greedy1", prompts[1], greedy),
        ("seeded", prompts[2], SamplingParams(temperature=0.9, seed=4, max_tokens=24,
                                              ignore_eos=True)),
        ("n2", prompts[3], SamplingParams(temperature=1.0, seed=8, n=2, max_tokens=20,
                                          ignore_eos=True, logprobs=1)),
        ("penalties", prompts[4], SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.4,
            presence_penalty=0.3, frequency_penalty=0.2)),
        ("min_tokens", prompts[5], SamplingParams(temperature=0.0, max_tokens=24,
                                                  stop_token_ids=[prompts[5][1]], min_tokens=4)),
        ("short", prompts[6], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)),
    ]


def _assert_same(got, want, got_lp, want_lp):
    assert got == want
    for key, entries in want_lp.items():
        assert len(got_lp[key]) == len(entries)
        for a, b in zip(got_lp[key], entries):
            assert a.rank == b.rank and a.top_token_ids == b.top_token_ids
            np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-4)
            np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, atol=1e-4)


def test_oracle_drafts_change_no_token(loaded, monkeypatch):
    requests = _requests()
    plain = _engine(loaded)
    want, want_lp = run_engine(plain, requests)
    oracle = OracleProposer([prompt + want[(rid, i)] for rid, prompt, sp in requests
                             for i in range(sp.n)], VOCAB)
    monkeypatch.setattr(scheduler_module, "propose_ngram", oracle)
    engine = _engine(loaded, SPEC)
    got, got_lp = run_engine(engine, requests)
    _assert_same(got, want, got_lp, want_lp)
    stats = engine.stats()
    assert stats.spec_decode_num_drafts == len(oracle.proposals) > 10
    assert stats.spec_decode_num_draft_tokens == sum(oracle.proposals)
    # Every third proposal breaks at its second draft; siblings of n=2 may take
    # each other's continuation — still most drafts are accepted.
    assert stats.spec_decode_acceptance_rate > 0.5
    # Blocks filled by accepted drafts are cached under their tokens: a prompt that
    # continues greedy0's output hits them, and decodes as without speculation.
    rid, prompt, sp = requests[0]
    follow = [("follow", prompt + want[(rid, 0)][:20], sp)]
    plain_hits, hits = plain.stats().prefix_cache_hits, stats.prefix_cache_hits
    got, _ = run_engine(engine, follow)
    assert got == run_engine(plain, follow)[0]
    new_hits = engine.stats().prefix_cache_hits - hits
    assert new_hits == plain.stats().prefix_cache_hits - plain_hits
    assert new_hits > len(prompt) // 4 * 4  # past the prompt: into the output's blocks


def test_ngram_drafts_change_no_token_across_preemption(loaded):
    requests = _requests()
    want, want_lp = run_engine(_engine(loaded), requests)
    engine = _engine(loaded, SPEC, num_blocks=MAX_LEN // 4 + 1, budget=16)  # preempts
    got, got_lp = run_engine(engine, requests)
    _assert_same(got, want, got_lp, want_lp)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_accepted_tokens > 0


def test_ngram_greedy_outputs_equal_plain_decoding_on_32_prompts(loaded):
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = [(f"p{i}", p, sp) for i, p in enumerate(_prompts(11, 32))]
    want, _ = run_engine(_engine(loaded), requests)
    engine = _engine(loaded, SPEC)
    got, _ = run_engine(engine, requests)
    assert got == want
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    assert not engine.async_scheduling  # drafts need the step before: planned in order


def test_a_model_drafting_for_itself_is_accepted_and_changes_no_token(loaded, tmp_path):
    requests = _requests()
    want, want_lp = run_engine(_engine(loaded), requests)
    engine = _engine(loaded, _draft_spec(tmp_path), draft=loaded)
    full = []  # a step whose sampling rows fill the R ladder's top proposes nothing
    real_update = engine.scheduler.update

    def update(step, result):
        if sum(step.sample) == 8:
            full.append(result.draft_token_ids)
        return real_update(step, result)

    engine.scheduler.update = update
    got, got_lp = run_engine(engine, requests)
    _assert_same(got, want, got_lp, want_lp)
    assert full and all(proposed is None for proposed in full)
    assert 0 < engine.worker.num_proposal_steps < engine.num_steps
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    before = engine.stats()
    # Two sequences: each draft takes a sampling slot, and the R ladder's top is 8.
    run_engine(engine, [(f"g{i}", p, greedy) for i, p in enumerate(_prompts(5, 2))])
    stats = engine.stats()
    drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    # The same weights propose what the target samples greedily: only float32 noise
    # between a one-token query and the verify step's several can flip an argmax.
    assert drafted >= 2 * 3 * 5 and accepted >= 0.95 * drafted, (accepted, drafted)


def test_a_smaller_draft_model_changes_no_token_across_preemption(loaded, small_draft):
    directory, draft = small_draft
    requests = _requests()
    want, want_lp = run_engine(_engine(loaded), requests)
    engine = _engine(loaded, _draft_spec(directory, k=2), num_blocks=MAX_LEN // 4 + 1,
                     budget=16, draft=draft)  # preempts
    got, got_lp = run_engine(engine, requests)
    _assert_same(got, want, got_lp, want_lp)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_a_draft_model_with_another_vocabulary_is_refused(loaded, tmp_path):
    make_tiny_model("LlamaForCausalLM", tmp_path, seed=9, num_hidden_layers=1, vocab_size=128)
    with pytest.raises(ValueError, match="vocabulary .*128 tokens.* differs"):
        _engine(loaded, _draft_spec(tmp_path), draft=load_model(tmp_path, "float32"))


def test_a_draft_model_that_does_not_load_is_named(loaded, tmp_path):
    with pytest.raises(ValueError, match=f"^speculative_config model {tmp_path}: .*no config"):
        _engine(loaded, _draft_spec(tmp_path))
