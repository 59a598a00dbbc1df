"""Verifying draft tokens: the rule on hand-checked slots, and the output distribution.

Oracle: exact math. A row of two slots (slot 0 verifies draft d, slot 1 samples
after it) must emit what sequential sampling emits: its first token ~ p0, the
draft accepted with probability p0(d), a rejected row's token ~ p0 without d
(the residual norm(max(0, p0 - δ_d)) of the rejection-sampling rule), and an
accepted row's second token ~ p1. Bound: Pearson chi-square p > 1e-4 per
distribution and |z| < 4.5 for the acceptance frequency, over 60,000 rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.stats import chi2

from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.sampler import (build_sampling_metadata, count_earlier_drafts, sample,
                                     verify_drafts)

P_BOUND = 1e-4


def test_verify_drafts_keeps_the_accepted_prefix_and_the_token_after_it():
    # rows: [0, 1, 2] drafts (5, 6) — sample 5 then 7: accepts one, keeps slots 0, 1;
    #       [3] no drafts; [4, 5] draft 9 — sample 8: rejects, keeps slot 4;
    #       [6, 7, 8] drafts (1, 2) — samples 1, 2, 3: accepts both, keeps all three.
    tokens = jnp.array([5, 7, 4, 11, 8, 9, 1, 2, 3], jnp.int32)
    draft = jnp.array([5, 6, -1, -1, 9, -1, 1, 2, -1], jnp.int32)
    start = jnp.array([0, 0, 0, 3, 4, 4, 6, 6, 6], jnp.int32)
    kept, last = verify_drafts(tokens, draft, start)
    assert kept.tolist() == [True, True, False, True, True, False, True, True, True]
    assert last.tolist() == [False, True, False, True, True, False, False, False, True]


def test_count_earlier_drafts_adds_the_rows_drafts_before_each_slot():
    counts = jnp.zeros((5, 4), jnp.int32).at[:, 0].set(1)
    draft = jnp.array([2, 3, -1, 1, -1], jnp.int32)
    start = jnp.array([0, 0, 0, 3, 3], jnp.int32)
    out = np.asarray(count_earlier_drafts(counts, draft, start))
    want = np.zeros((5, 4), np.int32)
    want[:, 0] = 1
    want[1, 2] += 1  # slot 1 follows draft 2
    want[2, [2, 3]] += 1  # slot 2 follows drafts 2 and 3
    want[4, 1] += 1  # the second row's slot 1 follows draft 1; the first row's do not count
    np.testing.assert_array_equal(out, want)


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    assert counts[expected == 0].sum() == 0, "a token of probability 0 was drawn"
    keep = expected > 0
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    return float(1.0 - chi2.cdf(stat, keep.sum() - 1))


def test_sample_then_verify_emits_the_unspeculated_distribution():
    vocab, pairs, draft_token = 8, 20_000, 3
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, vocab)).astype(np.float32) * 1.5
    p0, p1 = (np.exp(l - np.logaddexp.reduce(l)) for l in logits.astype(np.float64))
    rows = 2 * pairs
    md = build_sampling_metadata([SamplingParams(temperature=1.0)] * rows,
                                 prompt_token_ids=[[0]] * rows, output_token_ids=[[]] * rows,
                                 vocab_size=vocab, positions=np.arange(rows) % 50 + 1,
                                 max_num_logprobs=2)
    draft = jnp.tile(jnp.array([draft_token, -1], jnp.int32), pairs)
    start = jnp.repeat(jnp.arange(0, rows, 2, dtype=jnp.int32), 2)

    @jax.jit
    def run(key):
        tokens = sample(jnp.tile(logits, (pairs, 1)), md, key).token_ids  # [2 pairs]
        return (*verify_drafts(tokens, draft, start), tokens)

    first, second, accepted = [], [], []
    for step in range(3):  # 60,000 rows in all, a fresh server key per step
        kept, last, tokens = (np.asarray(a) for a in run(
            jax.random.key_data(jax.random.PRNGKey(100 + step))))
        tokens = tokens.reshape(pairs, 2)
        kept, last = kept.reshape(pairs, 2), last.reshape(pairs, 2)
        ok = tokens[:, 0] == draft_token
        np.testing.assert_array_equal(kept[:, 0], True)
        np.testing.assert_array_equal(kept[:, 1], ok)
        np.testing.assert_array_equal(last[:, 1], ok)
        np.testing.assert_array_equal(last[:, 0], ~ok)
        first.append(tokens[:, 0])
        accepted.append(ok)
        second.append(tokens[ok, 1])
    first, accepted, second = (np.concatenate(a) for a in (first, accepted, second))
    n = len(first)
    z = (accepted.sum() - n * p0[draft_token]) / np.sqrt(n * p0[draft_token] * (1 - p0[draft_token]))
    assert abs(z) < 4.5, (accepted.mean(), p0[draft_token])
    assert _chi_square_p(np.bincount(first, minlength=vocab), p0) > P_BOUND
    residual = np.where(np.arange(vocab) == draft_token, 0.0, p0)
    rejected = np.bincount(first[~accepted], minlength=vocab)
    assert _chi_square_p(rejected, residual / residual.sum()) > P_BOUND
    assert _chi_square_p(np.bincount(second, minlength=vocab), p1) > P_BOUND
    # The negative control: the test rejects a second token drawn from p0 instead.
    assert _chi_square_p(np.bincount(second, minlength=vocab), p0) < P_BOUND


def test_greedy_rows_keep_a_draft_exactly_when_it_is_the_argmax():
    logits = jnp.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    md = build_sampling_metadata([SamplingParams(temperature=0.0)] * 4,
                                 prompt_token_ids=[[0]] * 4, output_token_ids=[[]] * 4,
                                 vocab_size=3, max_num_logprobs=2)
    tokens = sample(logits, md, jnp.zeros(2, jnp.uint32)).token_ids  # [1, 0, 2, 0]
    # row A: slots 0-2 with drafts (1, 1): slot 1 samples 0 != 1 -> keeps slots 0, 1
    # row B: slot 3, no drafts
    kept, _ = verify_drafts(tokens, jnp.array([1, 1, -1, -1], jnp.int32),
                            jnp.array([0, 0, 0, 3], jnp.int32))
    assert tokens.tolist() == [1, 0, 2, 0]
    assert kept.tolist() == [True, True, False, True]
