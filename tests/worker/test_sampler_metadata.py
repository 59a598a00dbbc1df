"""The metadata builder, output-count updates, and one executable per R."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.sampler import (SamplingMetadata, build_sampling_metadata, sample,
                                     update_output_counts)
from jaxserve.worker.sampler.metadata import seed_words

VOCAB = 100


def test_builder_fields():
    params = [SamplingParams(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, seed=2**33 + 5,
                             repetition_penalty=1.2, presence_penalty=0.3,
                             frequency_penalty=-0.4, logit_bias={9: 2.0, 3: -1.0},
                             stop_token_ids=[4], min_tokens=3, logprobs=4),
              SamplingParams(temperature=0.0, top_k=3, top_p=0.5, ignore_eos=True),
              SamplingParams(top_k=VOCAB + 10)]
    md = build_sampling_metadata(params, prompt_token_ids=[[1, 2, 2], [5], [6]],
                                 output_token_ids=[[8, 8, 7], [], [1]], vocab_size=VOCAB,
                                 eos_token_ids=(0,), num_rows=4)
    assert md.temperature.tolist() == pytest.approx([0.5, 0.0, 1.0, 0.0])
    assert md.top_k.tolist() == [7, 0, 0, 0]  # greedy rows and k >= V are off
    assert md.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0, 1.0])
    assert md.seeds[0].tolist() == [2, 5] and md.seeded.tolist() == [True, False, False, False]
    assert md.positions.tolist() == [6, 1, 2, 0]
    assert np.flatnonzero(md.prompt_mask[0]).tolist() == [1, 2]
    assert md.output_counts[0, 8] == 2 and md.output_counts[0, 7] == 1
    assert md.output_counts.sum() == 4
    assert sorted(zip(md.logit_bias_ids[0][:2], md.logit_bias_values[0][:2])) == [
        (3, -1.0), (9, 2.0)]
    assert (md.logit_bias_ids[1:] == -1).all()
    assert md.banned_ids[0, :2].tolist() == [4, 0] and md.banned_ids[1, 0] == -1
    assert md.ban_active.tolist() == [False, False, False, False]  # 3 outputs = min_tokens
    assert md.num_logprobs.tolist() == [4, -1, -1, -1]


def test_seed_words_match_prng_key():
    for seed in (0, 7, 2**31 + 1, 2**32 - 1):
        np.testing.assert_array_equal(
            seed_words(seed), jax.random.key_data(jax.random.PRNGKey(seed)))
    assert seed_words(2**40 + 3) == (256, 3)  # PRNGKey's words with jax_enable_x64
    assert seed_words(-1) == (0xFFFFFFFF, 0xFFFFFFFF)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_token_ids=[[VOCAB]]), "prompt_token_ids"),
    (dict(output_token_ids=[[-1]]), "output_token_ids"),
    (dict(params=[SamplingParams(logit_bias={VOCAB: 1.0})]), "logit_bias"),
    (dict(params=[SamplingParams(logit_bias={i: 1.0 for i in range(5)})],
          logit_bias_width=4), "logit_bias"),
    (dict(params=[SamplingParams(stop_token_ids=[1, 2, 3])], banned_width=2), "stop_token_ids"),
    (dict(params=[SamplingParams(logprobs=5)], max_num_logprobs=4), "logprobs"),
    (dict(num_rows=0), "num_rows"),
])
def test_builder_errors(kwargs, match):
    args = dict(params=[SamplingParams()], prompt_token_ids=[[1]], output_token_ids=[[]],
                vocab_size=VOCAB)
    args.update(kwargs)
    params = args.pop("params")
    with pytest.raises(ValueError, match=match):
        build_sampling_metadata(params, **args)


def test_bad_static_fields():
    md = build_sampling_metadata([SamplingParams()], prompt_token_ids=[[1]],
                                 output_token_ids=[[]], vocab_size=VOCAB)
    leaves = {f: getattr(md, f) for f in md.__dataclass_fields__}
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingMetadata(**{**leaves, "logprobs_mode": "logits"})
    with pytest.raises(ValueError, match="max_num_logprobs"):
        SamplingMetadata(**{**leaves, "max_num_logprobs": 21})


def test_update_output_counts_matches_builder():
    rng = np.random.default_rng(0)
    history = [list(rng.integers(0, VOCAB, 6)) for _ in range(5)]
    counts = jnp.zeros((5, VOCAB), jnp.int32)
    for step in range(6):
        counts = update_output_counts(counts, jnp.asarray([h[step] for h in history], jnp.int32))
    md = build_sampling_metadata([SamplingParams()] * 5, prompt_token_ids=[[1]] * 5,
                                 output_token_ids=history, vocab_size=VOCAB)
    np.testing.assert_array_equal(counts, md.output_counts)
    skipped = update_output_counts(counts, jnp.asarray([-1, 3, -1, -1, -1], jnp.int32))
    assert int(skipped.sum()) == 31 and int(skipped[1, 3]) == int(md.output_counts[1, 3]) + 1


def test_one_executable_serves_every_mix():
    """Greedy-only, plain, filtered, penalized and logprob batches share one compile."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, VOCAB)).astype(np.float32)
    mixes = [
        [SamplingParams(temperature=0)] * 8,
        [SamplingParams()] * 8,
        [SamplingParams(top_k=5, top_p=0.9, min_p=0.1)] * 8,
        [SamplingParams(repetition_penalty=1.2, logit_bias={1: 1.0}, seed=3, logprobs=2,
                        min_tokens=2, stop_token_ids=[5])] * 4 + [SamplingParams()] * 4,
    ]
    before = sample._cache_size()
    for params in mixes:
        md = build_sampling_metadata(params, prompt_token_ids=[[1]] * 8,
                                     output_token_ids=[[]] * 8, vocab_size=VOCAB)
        sample(logits, md, jax.random.key(0)).token_ids.block_until_ready()
    assert sample._cache_size() - before <= 1


def test_no_full_vocabulary_sort():
    """Top-k candidates stay XLA's partial-sort TopK, never a sort of [R, V]."""
    vocab = 4096
    md = build_sampling_metadata([SamplingParams(top_k=50, top_p=0.9)] * 8,
                                 prompt_token_ids=[[1]] * 8, output_token_ids=[[]] * 8,
                                 vocab_size=vocab)
    hlo = sample.lower(np.zeros((8, vocab), np.float32), md, jax.random.key(0)).compile()
    text = hlo.as_text()
    if jax.default_backend() == "cpu":
        assert 'custom_call_target="TopK"' in text
    assert not any(" sort(" in line and f",{vocab}]" in line for line in text.splitlines())


def test_shape_mismatch_and_narrow_logits():
    md = build_sampling_metadata([SamplingParams(temperature=0)] * 2, prompt_token_ids=[[1]] * 2,
                                 output_token_ids=[[]] * 2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="disagree"):
        sample(np.zeros((2, VOCAB + 1), np.float32), md, jax.random.key(0))
    logits = np.random.default_rng(0).normal(size=(2, VOCAB)).astype(jnp.bfloat16)
    out = sample(logits, md, jax.random.key(0))
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits.astype(np.float32), -1))
