"""Engine + in-process worker on a tiny random-weight Llama, against transformers.

Oracle: Hugging Face transformers (PyTorch, float32) running the same
weights with no cache, one full forward per generated token, and NumPy for
the penalties and bans. Greedy tokens must be equal; logprobs within 1e-4
(float32 sums in a different order; observed ~1e-6).
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, SchedulerConfig
from jaxserve.model.loader import load_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import NewRow, StepPlan
from jaxserve.worker import InProcessWorker
from tests.model.hf_tiny import make_tiny_model
from tests.worker.engine_runs import run_engine, tracked

VOCAB = 256
MAX_LEN = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama")
    hf = make_tiny_model("LlamaForCausalLM", directory, seed=7)
    return hf, load_model(directory, "float32"), directory


def _engine(loaded, budget=32, num_blocks=200, caching=True, max_num_seqs=8, block_size=4,
            scan_layers=False, **sched):
    config = EngineConfig(
        max_model_len=MAX_LEN, seed=5, scan_layers=scan_layers,
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  **sched),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks,
                          enable_prefix_caching=caching))
    return tracked(EngineCore(config, InProcessWorker(loaded)))


def _hf_last_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids]), use_cache=False).logits[0, -1].double().numpy()


def _hf_greedy(hf, prompt, num, rep=1.0, presence=0.0, frequency=0.0, banned=(), min_tokens=0):
    """Greedy continuation with vLLM's penalties and min-tokens bans applied in NumPy."""
    out, lps = [], []
    for _ in range(num):
        logits = _hf_last_logits(hf, prompt + out)
        raw = logits - np.logaddexp.reduce(logits)
        if len(out) < min_tokens:
            logits[list(banned)] = -np.inf
        counts = np.bincount(out, minlength=VOCAB)
        seen = (counts > 0) | np.isin(np.arange(VOCAB), prompt)
        logits = np.where(seen, np.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - frequency * counts - presence * (counts > 0)
        token = int(np.argmax(logits))
        out.append(token)
        lps.append(raw)
        if len(out) >= min_tokens and token in banned:
            break
    return out, lps


def _prompts(seed, num=8):
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(13)]
    return [(shared if i % 3 == 0 else []) + [rng.randrange(3, VOCAB)
                                               for _ in range(rng.randrange(1, 50))]
            for i in range(num)]


@pytest.mark.parametrize("variant", ["cached", "no_cache_budget_8", "tiny_cache",
                                     "scanned_tiny_cache"])
def test_greedy_tokens_and_logprobs_equal_transformers(tiny, variant):
    hf, loaded, directory = tiny
    kwargs = {"cached": dict(), "no_cache_budget_8": dict(caching=False, budget=8),
              "tiny_cache": dict(num_blocks=MAX_LEN // 4 + 1),
              "scanned_tiny_cache": dict(num_blocks=MAX_LEN // 4 + 1, scan_layers=True)}[variant]
    if kwargs.get("scan_layers"):  # stacked weights and KV cache, jax.lax.scan over layers
        loaded = load_model(directory, "float32", scan_layers=True)
    engine = _engine(loaded, **kwargs)
    prompts = _prompts(1)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    tokens, logprobs = run_engine(engine, [(f"p{i}", p, sp) for i, p in enumerate(prompts)])
    if variant.endswith("tiny_cache"):
        assert engine.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        want, raw = _hf_greedy(hf, prompt, 6)
        assert tokens[(f"p{i}", 0)] == want, i
        for token, got, ref in zip(want, logprobs[(f"p{i}", 0)], raw):
            assert got.rank == 1
            np.testing.assert_allclose(got.logprob, ref[token], atol=1e-4)
            top2 = np.argsort(-ref)[:2]
            assert list(got.top_token_ids) == top2.tolist()
            np.testing.assert_allclose(got.top_logprobs, ref[top2], atol=1e-4)


def test_penalties_and_min_tokens_follow_the_reference_across_preemption(tiny):
    hf, loaded, _ = tiny
    prompts = _prompts(2, num=6)
    greedy_first = _hf_greedy(hf, prompts[1], 1)[0][0]
    pen = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                         repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=0.4)
    ban = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                         stop_token_ids=[greedy_first], min_tokens=3)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [("pen0", prompts[0], pen), ("ban", prompts[1], ban), ("plain", prompts[2], plain),
                ("pen3", prompts[3], pen), ("plain4", prompts[4], plain), ("pen5", prompts[5], pen)]
    engine = _engine(loaded, num_blocks=MAX_LEN // 4 + 1, budget=16)
    tokens, _ = run_engine(engine, requests)
    assert engine.stats().num_preemptions > 0
    for rid, prompt, sp in requests:
        want, _ = _hf_greedy(hf, prompt, 8, sp.repetition_penalty, sp.presence_penalty,
                             sp.frequency_penalty, sp.stop_token_ids, sp.min_tokens)
        assert tokens[(rid, 0)] == want, rid
    assert greedy_first not in tokens[("ban", 0)][:3]


def test_seeded_sampling_is_independent_of_batch_and_preemption(tiny):
    _, loaded, _ = tiny
    prompt = _prompts(3, num=1)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone, _ = run_engine(_engine(loaded), [("s", prompt, sp)])
    rng = random.Random(9)
    others = [(f"o{i}", [rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 60))],
               SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True))
              for i in range(7)]
    engine = _engine(loaded, num_blocks=MAX_LEN // 4 + 1, budget=16)
    crowded, _ = run_engine(engine, others[:4] + [("s", prompt, sp)] + others[4:])
    assert engine.stats().num_preemptions > 0
    assert crowded[("s", 0)] == alone[("s", 0)]
    sibling, _ = run_engine(_engine(loaded), [("n", prompt, SamplingParams(
        n=2, temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True))])
    assert sibling[("n", 0)] == alone[("s", 0)]  # child i uses seed + i (vLLM)
    assert sibling[("n", 1)] != alone[("s", 0)]


def test_only_ladder_shapes_reach_the_executables(tiny, monkeypatch):
    """500 random requests: every executable call has a ladder shape."""
    from jaxserve.worker.in_process import InProcessWorker

    _, loaded, _ = tiny
    shapes = set()
    run = InProcessWorker._call

    def spy(self, name, jitted, *args):
        bucket = int(re.search(r"[TR]=(\d+)", name).group(1)) if "=" in name else None
        if name.startswith("body["):
            _, _, block_table, last_token, buffer = args
            shapes.add(("T", bucket, buffer.shape, (block_table.shape, last_token.shape)))
        elif name.startswith("sampler["):
            _, hidden, _, _, last_token, _, _, _ = args
            shapes.add(("R", bucket, name, (hidden.shape, last_token.shape)))
        assert name in self.functions, f"{name} was not compiled at start-up"
        return run(self, name, jitted, *args)

    monkeypatch.setattr(InProcessWorker, "_call", spy)
    t_ladder, r_ladder = (1, 4, 8, 16, 32, 64, 128), (1, 2, 4, 8, 16, 32)
    engine = _engine(loaded, budget=128, max_num_seqs=32, num_blocks=400,
                     token_buckets=t_ladder, request_buckets=r_ladder)
    rng = random.Random(11)
    requests = []
    for i in range(500):
        temp = rng.choice([0.0, 0.7, 1.0])
        sp = SamplingParams(n=rng.choice([1, 1, 2]), temperature=temp, max_tokens=rng.randrange(1, 10),
                            seed=rng.choice([None, i]), top_k=rng.choice([0, 20]))
        requests.append((f"r{i}", [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 100))],
                         sp))
    tokens, _ = run_engine(engine, requests)
    assert len(tokens) == sum(sp.n for _, _, sp in requests)
    pairs = set(engine.worker.executed_buckets)
    assert {t for t, _ in pairs} <= set(t_ladder) and {r for _, r in pairs} <= set(r_ladder) | {0}
    body_t = {s[1] for s in shapes if s[0] == "T"}
    sample_r = {s[1] for s in shapes if s[0] == "R"}
    assert body_t <= set(t_ladder) and sample_r <= set(r_ladder)
    # The persistent rows and the sampler's hidden rows are fixed; the body's packed
    # buffer is keyed on T alone, the sampler on R and its variant.
    assert len({s[3] for s in shapes}) == 2
    assert len({s[1:3] for s in shapes if s[0] == "T"}) == len(body_t)
    assert engine.stats().kv_blocks_used == 0


def test_worker_rejects_off_ladder_buckets_and_inconsistent_plans(tiny):
    _, loaded, _ = tiny
    engine = _engine(loaded)
    worker, i32 = engine.worker, lambda x: np.array(x, np.int32)
    new = NewRow(0, i32([5, 6, 7]), 3, SamplingParams(), None, i32([1]))

    def plan(t=4, r=1, freed=(), new_rows=(new,), computed=0, n=3, sample=True):
        return StepPlan(0, i32(freed), tuple(new_rows), i32([]), i32([]), i32([0]),
                        i32([computed]), i32([n]), np.array([sample]), t, r)

    with pytest.raises(ValueError, match="ladder"):
        worker.execute(plan(t=3))
    with pytest.raises(ValueError, match="not in use"):
        worker.execute(plan(freed=[5]))
    with pytest.raises(ValueError, match="lack tokens or blocks"):
        worker.execute(plan(new_rows=(NewRow(1, i32([5]), 1, SamplingParams(), None, i32([2])),),
                            computed=0, n=3))
    assert worker.execute(plan(freed=[1])).token_ids.shape == (1,)
