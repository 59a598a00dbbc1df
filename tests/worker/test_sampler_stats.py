"""Statistics: 100,000 draws per row vs the exact filtered, tempered distribution.

One batch holds several parameter mixes; each mix is tiled over many rows
with distinct positions (seeded mixes) or distinct rows (unseeded mixes), so
every row is an independent draw. Bound: a Pearson chi-square test per mix
must give p > 1e-4 (categories with expected count < 5 are pooled; tokens of
probability 0 must never be drawn). A negative control checks the test has
the power to reject a distribution that is only slightly wrong.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.stats import chi2

from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.sampler import build_sampling_metadata, reference, sample

DRAWS = 100_000
CHUNK = 25_000  # draws per mix per call
P_BOUND = 1e-4
VOCAB = 53  # prime: the two-level draw has a short last block


def mixes() -> list[SamplingParams]:
    return [
        SamplingParams(seed=11),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.7, top_k=5, seed=12),
        SamplingParams(top_p=0.7),
        SamplingParams(temperature=1.2, min_p=0.2, seed=13),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=14),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                       logit_bias={3: 1.5, 40: -2.0}, seed=15),
        SamplingParams(top_k=10, top_p=0.95, temperature=1.3),  # tie-heavy row
        SamplingParams(temperature=0.0),
    ]


def tiled_metadata(template, chunk: int, start: int):
    """Repeats every row of ``template`` ``chunk`` times with positions start + m."""
    def tile(a):
        a = np.asarray(a)
        return np.repeat(a, chunk, axis=0)
    leaves, treedef = jax.tree_util.tree_flatten(template)
    md = jax.tree_util.tree_unflatten(treedef, [tile(a) for a in leaves])
    rows = md.temperature.shape[0]
    positions = start + np.tile(np.arange(chunk, dtype=np.int32), rows // chunk)
    return jax.tree_util.tree_unflatten(
        treedef, [positions if a is md.positions else a
                  for a in jax.tree_util.tree_leaves(md)])


def draw_counts(logits, template, num_candidates: int) -> np.ndarray:
    """i64[mixes, V] token counts over DRAWS draws per mix."""
    n_mix, vocab = logits.shape
    counts = np.zeros((n_mix, vocab), np.int64)
    run = jax.jit(sample, static_argnames=("num_candidates",))
    for call in range(DRAWS // CHUNK):
        md = tiled_metadata(template, CHUNK, start=call * CHUNK)
        tiled_logits = np.repeat(logits, CHUNK, axis=0)
        out = run(tiled_logits, md, jax.random.key(1000 + call), num_candidates=num_candidates)
        tokens = np.asarray(out.token_ids).reshape(n_mix, CHUNK)
        for j in range(n_mix):
            counts[j] += np.bincount(tokens[j], minlength=vocab)
    return counts


def chi_square_p(observed: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value, pooling categories with expected count < 5."""
    n = observed.sum()
    zero = probs == 0
    assert observed[zero].sum() == 0, "drew a token of probability 0"
    expected = n * probs[~zero]
    obs = observed[~zero]
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    if expected.size < 2:
        return 1.0
    stat = float(np.sum((obs - expected) ** 2 / expected))
    return float(chi2.sf(jnp.float32(stat), expected.size - 1))


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(2024)
    params = mixes()
    logits = rng.normal(0.0, 1.5, (len(params), VOCAB)).astype(np.float32)
    logits[7] = np.round(logits[7])  # ties, including at the top-k / top-p cuts
    prompts = [[2, 3, 5]] * len(params)
    outputs = [[3, 7, 7, 9]] * len(params)
    # Narrow bias / ban widths: the test tiles this batch over 225,000 rows.
    template = build_sampling_metadata(params, prompt_token_ids=prompts,
                                       output_token_ids=outputs, vocab_size=VOCAB,
                                       logit_bias_width=2, banned_width=1)
    exact = np.stack([reference.distribution(logits[j], p, prompts[j], outputs[j])
                      for j, p in enumerate(params)])
    return params, logits, template, exact


@pytest.mark.parametrize("num_candidates", [VOCAB, 8])
def test_chi_square_per_mix(setup, num_candidates):
    params, logits, template, exact = setup
    counts = draw_counts(logits, template, num_candidates)
    for j, p in enumerate(params):
        if p.is_greedy:
            assert counts[j, np.argmax(exact[j])] == DRAWS
            continue
        pval = chi_square_p(counts[j], exact[j])
        assert pval > P_BOUND, f"mix {j} ({p}): p = {pval:.2e}"
        assert (exact[j] > 0).sum() > 1  # the mix really is random


def test_chi_square_has_power(setup):
    """Negative control: a 5% temperature error is rejected at the same bound."""
    params, logits, template, exact = setup
    counts = draw_counts(logits[:2], jax.tree_util.tree_map(lambda a: a[:2], template), VOCAB)
    wrong = reference.distribution(logits[1], SamplingParams(temperature=0.525), [2, 3, 5],
                                   [3, 7, 7, 9])
    assert chi_square_p(counts[1], exact[1]) > P_BOUND
    assert chi_square_p(counts[1], wrong) < P_BOUND
