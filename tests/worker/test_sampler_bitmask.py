"""The structured-output token bitmask in the sampler (MASKED variant) against exact math.

- pack / unpack / ``apply_token_bitmask`` against NumPy, bit order included;
- MASKED on raw logits is bit for bit FULL on logits whose disallowed tokens
  were set to -inf by NumPy first (so the mask comes before every stage), and
  MASKED_SAMPLED SAMPLED's on the rows SAMPLED covers; ``masked_variant``
  picks MASKED_SAMPLED only for rows SAMPLED covers;
- draws never pick a disallowed token, and stay inside the support of the
  NumPy reference distribution of the masked logits (top-k / top-p / min-p
  on the masked distribution); frequencies within 6 sigma of it;
- logprobs are the log-softmax of the masked logits; greedy rows take the
  argmax of the allowed tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.sampler import (FULL, GREEDY, MASKED, MASKED_SAMPLED, PROCESSED, SAMPLED,
                                     build_sampling_metadata, covering_variant,
                                     masked_variant, sample)
from jaxserve.worker.sampler.bitmask import (apply_token_bitmask, num_words, pack_bitmask,
                                             unpack_bitmask)
from jaxserve.worker.sampler.reference import distribution, log_softmax

VOCAB = 300  # not a multiple of 32: the last word is partial
KC = 16

PARAMS = [
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=1.0, logprobs=3),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=1.3, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.9),  # top-k past the candidates
    SamplingParams(temperature=1.0, repetition_penalty=1.3, logit_bias={7: 5.0}),
    SamplingParams(temperature=1.0),  # left unconstrained (all ones)
]


def _allowed(rng: np.random.Generator, rows: int) -> np.ndarray:
    allowed = rng.random((rows, VOCAB)) < 0.3
    allowed[:, rng.integers(0, VOCAB)] = True  # never empty
    allowed[-1] = True  # the last row unconstrained
    return allowed


def test_pack_unpack_and_apply_match_numpy():
    rng = np.random.default_rng(0)
    allowed = rng.random((5, VOCAB)) < 0.5
    packed = pack_bitmask(allowed)
    assert packed.dtype == np.int32 and packed.shape == (5, num_words(VOCAB))
    for t in rng.integers(0, VOCAB, 50).tolist():  # llguidance's layout, bit by bit
        word = int(packed[0, t // 32]) & 0xFFFFFFFF
        assert bool((word >> (t % 32)) & 1) == allowed[0, t]
    np.testing.assert_array_equal(unpack_bitmask(packed, VOCAB), allowed)
    logits = rng.normal(size=(5, VOCAB)).astype(np.float32)
    got = np.asarray(jax.jit(apply_token_bitmask)(logits, packed))
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))
    with pytest.raises(ValueError, match="does not fit"):
        apply_token_bitmask(jnp.asarray(logits), jnp.asarray(packed[:, :-1]))


def _metadata(params, prompt, outputs, positions):
    return build_sampling_metadata(params, prompt_token_ids=prompt, output_token_ids=outputs,
                                   vocab_size=VOCAB, positions=positions, max_num_logprobs=3)


# The rows SAMPLED covers: greedy, plain temperature, top-k inside the candidates, min-p.
SAMPLED_PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                  SamplingParams(temperature=0.7, top_k=5),
                  SamplingParams(temperature=1.3, min_p=0.2),
                  SamplingParams(temperature=1.0)]  # the last unconstrained (all ones)
ALL_FIELDS = ("token_ids", "logprob", "rank", "top_logprobs", "top_token_ids")


@pytest.mark.parametrize("masked, plain, params, fields, seed", [
    (MASKED, FULL, PARAMS, ALL_FIELDS, 1),
    (MASKED_SAMPLED, SAMPLED, SAMPLED_PARAMS, ("token_ids",), 3),  # SAMPLED has no logprobs
])
def test_a_masked_variant_is_its_plain_one_on_premasked_logits_bit_for_bit(masked, plain, params,
                                                                           fields, seed):
    rng = np.random.default_rng(seed)
    rows = len(params)
    logits = rng.normal(0, 2, (rows, VOCAB)).astype(np.float32)
    allowed = _allowed(rng, rows)
    md = _metadata(params, [[1, 2, 3]] * rows, [[4]] * rows, list(range(rows)))
    for step in range(3):
        key = jax.random.key(step)
        got = jax.device_get(sample(logits, md, key, pack_bitmask(allowed), variant=masked,
                                    num_candidates=KC))
        want = jax.device_get(sample(np.where(allowed, logits, -np.inf).astype(np.float32), md,
                                     key, variant=plain, num_candidates=KC))
        for field in fields:
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field), field)
        assert allowed[np.arange(rows), got.token_ids].all()


def test_a_constrained_step_pays_for_the_searches_only_when_a_row_needs_them():
    assert masked_variant(GREEDY) == masked_variant(SAMPLED) == MASKED_SAMPLED
    assert masked_variant(PROCESSED) == masked_variant(FULL) == MASKED
    for variant in (GREEDY, SAMPLED, PROCESSED, FULL):  # unconstrained: never a masked one
        assert not covering_variant(variant).mask


def test_draws_follow_the_masked_reference_distribution():
    rng = np.random.default_rng(2)
    copies, calls = 64, 8
    base = len(PARAMS)
    logits1 = rng.normal(0, 1.5, (base, VOCAB)).astype(np.float32)
    allowed1 = _allowed(rng, base)
    params = PARAMS * copies
    logits, allowed = np.tile(logits1, (copies, 1)), np.tile(allowed1, (copies, 1))
    md = _metadata(params, [[1, 2, 3]] * len(params), [[4]] * len(params),
                   list(range(len(params))))
    counts = np.zeros((base, VOCAB))
    for call in range(calls):
        out = jax.device_get(sample(logits, md, jax.random.key(100 + call), pack_bitmask(allowed),
                                    variant=MASKED, num_candidates=KC))
        tokens = out.token_ids.reshape(copies, base)
        assert allowed1[np.arange(base), tokens].all(), "a disallowed token was drawn"
        for row in range(base):
            np.add.at(counts[row], tokens[:, row], 1)
        if call == 0:  # logprobs (raw mode) are those of the masked logits
            for row in (0, 1):
                want = log_softmax(np.where(allowed1[row], logits1[row], -np.inf))
                np.testing.assert_allclose(out.logprob[row], want[out.token_ids[row]],
                                           rtol=1e-5, atol=1e-5)
                np.testing.assert_array_equal(out.top_token_ids[row],
                                              np.argsort(-want, kind="stable")[:3])
    n = copies * calls
    for row, sp in enumerate(PARAMS):
        probs = distribution(np.where(allowed1[row], logits1[row], -np.inf), sp, [1, 2, 3], [4])
        assert probs[~allowed1[row]].sum() == 0
        outside = counts[row][probs == 0].sum()
        assert outside == 0, (row, sp, "drawn outside the masked distribution's support")
        sigma = np.sqrt(n * probs * (1 - probs)) + 1e-9
        assert (np.abs(counts[row] - n * probs) <= 6 * sigma + 1).all(), (row, sp)
    greedy = np.where(allowed1[0], logits1[0], -np.inf).argmax()
    assert counts[0, greedy] == n
