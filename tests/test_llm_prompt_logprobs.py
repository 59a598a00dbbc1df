"""``SamplingParams.prompt_logprobs`` through ``LLM.generate``, against transformers.

A tiny random-weight Llama. For each prompt position i >= 1 the entry must
hold the prompt token's logprob given tokens < i — ``log_softmax`` of the
Hugging Face model's logits at i - 1 — with vLLM's rank (1 + tokens with a
larger logit) and the top N alternatives in order (ranks 1..N). The step
budget (16 tokens) is shorter than the long prompt, so its entries come from
several chunked-prefill steps; in the batch only some requests ask. A
request asking for prompt logprobs takes no prefix-cache hit (its cached
prefix would have no logits). The strict recompile guard is on: the
prompt-logprob executables were compiled at start-up (in the background),
never in a step, and a step without prompt-logprob rows does not run them.
Both workers serve it: in-process and the gRPC worker
process (the results cross ``plan_codec``). Prompts are token ids (V = 256;
the demo tokenizer only decodes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from tests.model.hf_tiny import hf_logits, make_tiny_model

BUDGET = 16
TOL = 2e-4  # float32 logprobs of two implementations of one model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_prompt_logprobs")
    model = make_tiny_model("LlamaForCausalLM", directory, seed=7)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 256, n).tolist() for n in (45, 7, 2, 19)]
    return directory, model, prompts


def _llm(tiny, tokenizer_dir, worker):
    directory, _, _ = tiny
    return LLM(str(directory), tokenizer=str(tokenizer_dir), max_num_seqs=4,
               max_num_batched_tokens=BUDGET, max_model_len=96, block_size=4,
               num_kv_blocks=128, token_buckets=(4, 16), request_buckets=(1, 4),
               strict_recompile=True, worker=worker)


def _want(model, prompt):
    """f32[P - 1, V]: log_softmax of the HF logits predicting prompt tokens 1 .. P - 1."""
    logits = torch.from_numpy(hf_logits(model, prompt)[:-1])
    return torch.log_softmax(logits, dim=-1).numpy()


def _check(model, prompt, got, n):
    assert len(got) == len(prompt) and got[0] is None
    want = _want(model, prompt)
    for i in range(1, len(prompt)):
        entry, row, token = got[i], want[i - 1], prompt[i]
        assert token in entry
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=TOL)
        assert entry[token].rank == 1 + int((row > row[token]).sum())
        top = [t for t in entry if t != token or entry[t].rank <= n]
        assert len(top) == n
        assert [entry[t].rank for t in top] == list(range(1, n + 1))
        order = np.argsort(-row, kind="stable")[:n]
        assert top == order.tolist()
        np.testing.assert_allclose([entry[t].logprob for t in top], row[order], atol=TOL)
        assert all(isinstance(e.decoded_token, str) for e in entry.values())


@pytest.fixture(scope="module", params=["in_process", "grpc"])
def llm(request, tiny, demo_model_dir):
    with _llm(tiny, demo_model_dir, request.param) as llm:
        yield llm


def test_prompt_logprobs_equal_transformers_over_chunked_prefill(tiny, llm):
    _, model, prompts = tiny
    asks = [5, None, 0, 3]
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=n)
              for n in asks]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(prompts[0]) > 2 * BUDGET  # its prompt logprobs span several steps
    for prompt, n, out in zip(prompts, asks, outputs):
        assert len(out.outputs[0].token_ids) == 3
        if n is None:
            assert out.prompt_logprobs is None
        else:
            _check(model, prompt, out.prompt_logprobs, n)
    assert llm.engine.stats().num_recompiles == 0


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(tiny, llm):
    _, model, prompts = tiny
    prompt = prompts[3]
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the prefix is in the cache
    asked = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, asked, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    _check(model, prompt, out.prompt_logprobs, 2)
    assert out.outputs[0].token_ids == first.outputs[0].token_ids


def test_n_samples_share_one_set_of_prompt_logprobs(tiny, llm):
    _, model, prompts = tiny
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=2, ignore_eos=True,
                            prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    _check(model, prompts[1], out.prompt_logprobs, 1)


def test_only_steps_with_prompt_logprob_rows_run_the_prompt_logprobs_executable(
        tiny, demo_model_dir, monkeypatch):
    _, _, prompts = tiny
    with _llm(tiny, demo_model_dir, "in_process") as llm:
        worker = llm.engine.worker
        calls = []
        real_call = worker._call

        def spy(name, jitted, *args):
            calls.append(name)
            return real_call(name, jitted, *args)

        monkeypatch.setattr(worker, "_call", spy)
        plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
        assert calls and not any(c.startswith("prompt_logprobs[") for c in calls)
        calls.clear()
        asked = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                               prompt_logprobs=1)
        llm.generate({"prompt_token_ids": prompts[0]}, asked, use_tqdm=False)
        bodies = [c for c in calls if c.startswith("body[")]
        scored = [c for c in calls if c.startswith("prompt_logprobs[")]
        # 45 prompt tokens at 16 per step: 3 prefill steps score, the 3 decodes do not
        assert len(scored) == 3 and len(bodies) == 3 + 3
        assert llm.engine.stats().num_recompiles == 0
