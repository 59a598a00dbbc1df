"""Logprobs equal log_softmax of the documented distribution to 1e-5.

raw (default, vLLM V1): log_softmax of the model's logits, before any
processing. processed: log of the distribution the row is sampled from
(``reference.distribution``); greedy rows: log_softmax of the penalized
logits at temperature 1, unfiltered. Reference in float64.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.sampler import build_sampling_metadata, reference, sample, token_logprobs

TOL = 1e-5
VOCAB = 300


def batch():
    rng = np.random.default_rng(11)
    params = [
        SamplingParams(logprobs=5),
        SamplingParams(temperature=0, logprobs=20, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, top_k=30, logprobs=0),
        SamplingParams(top_p=0.8, min_p=0.02, logprobs=3, presence_penalty=1.0, seed=4),
        SamplingParams(),  # no logprobs
        SamplingParams(temperature=1.4, top_k=200, top_p=0.97, logprobs=20,
                       logit_bias={7: 3.0}, frequency_penalty=0.5),
    ]
    prompts = [list(rng.integers(0, VOCAB, 10)) for _ in params]
    outputs = [list(rng.integers(0, VOCAB, 5)) for _ in params]
    logits = rng.normal(0.0, 3.0, (len(params), VOCAB)).astype(np.float32)
    return params, prompts, outputs, logits


def expected_logprobs(mode, logits, p, prompt, output):
    """f64[V]: the documented distribution's log-probabilities for one row."""
    if mode == "raw":
        return reference.log_softmax(logits)
    if p.is_greedy:
        return reference.log_softmax(reference.penalized_logits(logits, p, prompt, output))
    with np.errstate(divide="ignore"):
        return np.log(reference.distribution(logits, p, prompt, output))


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("num_candidates", [128, 16])
def test_logprobs_match_reference(mode, num_candidates):
    params, prompts, outputs, logits = batch()
    md = build_sampling_metadata(params, prompt_token_ids=prompts, output_token_ids=outputs,
                                 vocab_size=VOCAB, logprobs_mode=mode, num_rows=8)
    padded = np.concatenate([logits, np.zeros((2, VOCAB), np.float32)])
    out = jax.device_get(sample(padded, md, jax.random.key(3), num_candidates=num_candidates))
    assert out.top_logprobs.shape == (8, 20) and out.top_token_ids.shape == (8, 20)
    for r, p in enumerate(params):
        token = int(out.token_ids[r])
        if p.logprobs is None:
            assert np.isnan(out.logprob[r]) and out.rank[r] == -1
            assert (out.top_token_ids[r] == -1).all()
            continue
        ref = expected_logprobs(mode, logits[r], p, prompts[r], outputs[r])
        assert np.isfinite(ref[token])
        np.testing.assert_allclose(out.logprob[r], ref[token], rtol=0, atol=TOL)
        assert out.rank[r] == 1 + np.sum(ref > ref[token] + TOL)
        n = p.logprobs
        order = np.argsort(-ref, kind="stable")[:n]
        np.testing.assert_array_equal(out.top_token_ids[r, :n], order)
        np.testing.assert_allclose(out.top_logprobs[r, :n], ref[order], rtol=0, atol=TOL)
        assert (out.top_token_ids[r, n:] == -1).all()
        assert np.isneginf(out.top_logprobs[r, n:]).all()


def test_no_logprob_outputs_when_static_width_is_zero():
    params, prompts, outputs, logits = batch()
    md = build_sampling_metadata(params[2:3], prompt_token_ids=prompts[2:3],
                                 output_token_ids=outputs[2:3], vocab_size=VOCAB,
                                 max_num_logprobs=0)
    out = sample(logits[2:3], md, jax.random.key(0))
    assert out.top_logprobs.shape == (1, 0)
    np.testing.assert_allclose(out.logprob[0], reference.log_softmax(logits[2])[
        int(out.token_ids[0])], atol=TOL)


def test_token_logprobs_serves_prompt_logprobs():
    """The helper works on any [N, V] logits (e.g. prompt positions)."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(7, VOCAB)).astype(np.float32)
    ids = rng.integers(0, VOCAB, 7).astype(np.int32)
    want = np.array([2, 0, -1, 5, 20, 1, 3], np.int32)
    lp, rank, top, top_ids = jax.jit(token_logprobs, static_argnames="max_num_logprobs")(
        logits, ids, want, max_num_logprobs=20)
    ref = reference.log_softmax(logits)
    for i in range(7):
        if want[i] < 0:
            assert np.isnan(lp[i])
            continue
        np.testing.assert_allclose(lp[i], ref[i, ids[i]], atol=TOL)
        assert rank[i] == 1 + np.sum(logits[i] > logits[i, ids[i]])
        np.testing.assert_array_equal(top_ids[i, :want[i]], np.argsort(-ref[i])[:want[i]])
