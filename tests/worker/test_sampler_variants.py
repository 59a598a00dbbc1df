"""Sampler variants: the host's choice is exact, and covered rows match FULL.

- ``choose_variant`` on random batches picks the expected variant, and
  ``sample(..., variant=chosen)`` returns exactly FULL's tokens and logprobs.
- For every variant, the rows it covers (by ``required_stages`` of the row
  alone) get FULL's results bit for bit inside any mixed batch.
- Property: ``choose_variant`` never picks a variant without a stage a row
  needs, and picks the first (cheapest) one that has them all; the needs are
  re-derived here from the parameters, row by row.

KC = 16 candidates (cheap top-k > KC rows); flat rows make top-p nuclei wider
than the candidates; tie-heavy rows put ties at the KC-th candidate.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.sampling_params import SAMPLING_EPS, SamplingParams
from jaxserve.worker.sampler import (FULL, GREEDY, PROCESSED, SAMPLED, SAMPLER_VARIANTS,
                                     SamplerVariant, build_sampling_metadata, choose_variant,
                                     sample)
from jaxserve.worker.sampler.variants import STAGES, required_stages

VOCAB = 300
KC = 16
ROWS = 24
FAMILIES = ("greedy", "sampled", "processed", "full")  # the level each family needs


def random_row(rng: np.random.Generator, family: str, strict: bool) -> SamplingParams:
    """A row that needs at most ``family``'s variant (exactly it when ``strict``)."""
    if family == "greedy":
        return SamplingParams(temperature=0.0)
    seed = int(rng.integers(0, 2**40)) if rng.random() < 0.5 else None
    temperature = float(rng.uniform(0.3, 1.5))
    top_k = int(rng.choice([0, -1, 1, 5, KC, VOCAB, VOCAB + 3]))
    k_inside = 0 < top_k <= KC
    top_p = float(rng.uniform(0.3, 0.99)) if k_inside and rng.random() < 0.6 else 1.0
    min_p = float(rng.uniform(0.0, 0.3)) if rng.random() < 0.4 else 0.0
    if family == "full":
        if strict or rng.random() < 0.5:  # a nucleus or a top-k past the candidates
            top_k, top_p = ((int(rng.integers(KC + 1, VOCAB)), float(rng.uniform(0.5, 1.0)))
                            if rng.random() < 0.4 else (0, float(rng.uniform(0.3, 0.99))))
        family = "processed"
    if family == "processed" and (strict or rng.random() < 0.5):
        kind = rng.integers(0, 5) if not strict else rng.integers(0, 4)
        extra = [dict(repetition_penalty=float(rng.uniform(0.7, 1.6))),
                 dict(presence_penalty=float(rng.uniform(-1, 1)),
                      frequency_penalty=float(rng.uniform(-1, 1))),
                 dict(logit_bias={int(rng.integers(0, VOCAB)): float(rng.uniform(-5, 5))}),
                 dict(logprobs=int(rng.integers(0, 6))),
                 dict(min_tokens=3, stop_token_ids=[int(rng.integers(2, VOCAB))])][kind]
        if rng.random() < 0.2:
            return SamplingParams(temperature=0.0, **extra)
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              seed=seed, **extra)
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          seed=seed)


def random_logits(rng: np.random.Generator, rows: int) -> np.ndarray:
    """f32[rows, V]: peaked, flat (wide nuclei), tie-heavy and all-equal rows."""
    out = rng.normal(0.0, 2.0, (rows, VOCAB)).astype(np.float32)
    kind = rng.integers(0, 5, rows)
    out[kind == 1] *= np.float32(0.05)  # flat: the nucleus spans most of V
    out[kind == 2] = np.round(out[kind == 2])  # ties at the KC-th candidate
    out[kind == 3] = np.float32(rng.normal())  # all equal
    return out


def batch(seed: int, level: int, mode: str = "raw"):
    """ROWS rows of families <= ``level``, at least one of exactly ``level``."""
    rng = np.random.default_rng(seed)
    families = rng.integers(0, level + 1, ROWS)
    families[rng.integers(0, ROWS)] = level
    params = [random_row(rng, FAMILIES[f], strict=f == level) for f in families]
    md = build_sampling_metadata(
        params, prompt_token_ids=[list(rng.integers(0, VOCAB, 6)) for _ in params],
        output_token_ids=[list(rng.integers(0, VOCAB, rng.integers(0, 5))) for _ in params],
        vocab_size=VOCAB, eos_token_ids=(0, 1), positions=list(rng.integers(0, 1000, ROWS)),
        logprobs_mode=mode, max_num_logprobs=5)
    return params, random_logits(rng, ROWS), md


def stages_of(md, rows=slice(None)) -> dict:
    """choose_variant's / required_stages' arguments from (host) metadata rows."""
    return dict(temperature=md.temperature[rows], top_k=md.top_k[rows], top_p=md.top_p[rows],
                min_p=md.min_p[rows], repetition_penalty=md.repetition_penalty[rows],
                presence_penalty=md.presence_penalty[rows],
                frequency_penalty=md.frequency_penalty[rows],
                logit_bias_ids=md.logit_bias_ids[rows], ban_active=md.ban_active[rows],
                num_logprobs=md.num_logprobs[rows], vocab_size=VOCAB, num_candidates=KC)


def run(logits, md, key, variant):
    return jax.device_get(sample(logits, md, key, variant=variant, num_candidates=KC))


def assert_rows_equal(got, want, rows, msg):
    for field in ("token_ids", "logprob", "rank", "top_logprobs", "top_token_ids"):
        np.testing.assert_array_equal(getattr(got, field)[rows], getattr(want, field)[rows],
                                      err_msg=f"{msg}: {field}")


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_chosen_variant_matches_most_general(mode):
    chosen_levels = []
    for seed in range(12):
        level = seed % len(FAMILIES)
        _, logits, md = batch(seed, level, mode)
        variant = choose_variant(**stages_of(md))
        assert variant == SAMPLER_VARIANTS[level], (seed, variant)
        chosen_levels.append(level)
        for step in range(2):
            key = jax.random.key(100 * seed + step)
            assert_rows_equal(run(logits, md, key, variant), run(logits, md, key, FULL),
                              slice(None), f"seed {seed} step {step} {variant}")
    assert set(chosen_levels) == set(range(len(SAMPLER_VARIANTS)))


@pytest.mark.parametrize("variant", SAMPLER_VARIANTS, ids=repr)
def test_rows_a_variant_covers_match_full(variant):
    """Inside batches of every family, the covered rows are bit-identical to FULL."""
    covered_total = 0
    for seed in range(4):
        params, logits, md = batch(1000 + seed, level=3, mode=("raw", "processed")[seed % 2])
        covered = np.array([variant.covers(required_stages(**stages_of(md, slice(r, r + 1))))
                            for r in range(ROWS)])
        covered_total += covered.sum()
        key = jax.random.key(seed)
        got, want = run(logits, md, key, variant), run(logits, md, key, FULL)
        assert_rows_equal(got, want, covered, f"seed {seed} {variant}")
        for r in np.flatnonzero(covered):  # greedy rows: np.argmax of the raw logits
            if params[r].is_greedy and variant != FULL and not variant.processing:
                assert got.token_ids[r] == np.argmax(logits[r]), r
    assert covered_total >= 8  # every variant covers some rows of these batches


def test_boundaries_of_the_choice():
    """Hand-picked rows at the top-k / top-p boundaries of the candidates."""
    def pick(*params: SamplingParams, vocab: int = VOCAB) -> SamplerVariant:
        md = build_sampling_metadata(list(params), prompt_token_ids=[[1]] * len(params),
                                     output_token_ids=[[]] * len(params), vocab_size=vocab)
        return choose_variant(**dict(stages_of(md), vocab_size=vocab))

    greedy, plain = SamplingParams(temperature=0), SamplingParams()
    assert pick(greedy, greedy) == GREEDY
    assert pick(greedy, SamplingParams(temperature=0, top_p=0.5, top_k=500)) == GREEDY
    assert pick(greedy, SamplingParams(temperature=0, logprobs=0)) == PROCESSED
    assert pick(greedy, SamplingParams(temperature=0, repetition_penalty=1.1)) == PROCESSED
    assert pick(greedy, plain) == SAMPLED
    assert pick(SamplingParams(top_k=KC, top_p=0.9, min_p=0.1)) == SAMPLED
    assert pick(SamplingParams(top_k=VOCAB)) == SAMPLED  # top-k >= V is off
    assert pick(SamplingParams(top_k=KC + 1)) == FULL
    assert pick(SamplingParams(top_p=0.9)) == FULL  # the nucleus may be wider than KC
    assert pick(SamplingParams(top_p=0.9, min_p=0.5)) == FULL
    assert pick(SamplingParams(top_p=0.9), vocab=KC) == SAMPLED  # KC >= V: no search
    assert pick(SamplingParams(top_k=KC, seed=3, min_tokens=2)) == PROCESSED


def test_variant_flags_are_validated_and_hashable():
    with pytest.raises(ValueError, match="search needs filters"):
        SamplerVariant(filters=False)
    with pytest.raises(ValueError, match="filters need random"):
        SamplerVariant(random=False, search=False)
    assert len({*SAMPLER_VARIANTS, *SAMPLER_VARIANTS}) == len(SAMPLER_VARIANTS) <= 4
    assert SAMPLER_VARIANTS[-1] == FULL == SamplerVariant()  # sample's default
    with pytest.raises(dataclasses.FrozenInstanceError):
        FULL.search = False  # type: ignore[misc]


def needed_by_row(temperature: float, top_k: int, top_p: float, min_p: float, penalized: bool,
                  biased: bool, banned: bool, num_logprobs: int, vocab: int) -> set[str]:
    """The stages one row needs, from the definitions (independent of variants.py)."""
    needed = set()
    if penalized or biased or banned:
        needed.add("processing")
    if num_logprobs >= 0:
        needed.add("logprobs")
    if np.float32(temperature) < np.float32(SAMPLING_EPS):  # greedy (f32, as the device)
        return needed
    needed.add("random")
    top_k_on = 0 < top_k < vocab
    if top_k_on or top_p < 1 or min_p > 0:
        needed.add("filters")
    candidates = min(KC, vocab)
    # The kept set provably ends at or above the KC-th candidate only with a
    # top-k <= KC (or when the candidates are the whole vocabulary).
    provably_inside = (top_k_on and top_k <= candidates) or candidates >= vocab
    if (top_k_on or top_p < 1) and not provably_inside:
        needed.add("search")
    return needed


ROW = st.fixed_dictionaries(dict(
    temperature=st.sampled_from([0.0, 1e-6, SAMPLING_EPS, 0.7]),
    top_k=st.sampled_from([-1, 0, 1, KC - 1, KC, KC + 1, 40, 299, 300, 305]),
    top_p=st.sampled_from([1.0, 0.999, 0.5]),
    min_p=st.sampled_from([0.0, 0.2]),
    repetition_penalty=st.sampled_from([1.0, 1.0, 0.9]),
    presence_penalty=st.sampled_from([0.0, 0.0, 0.5]),
    frequency_penalty=st.sampled_from([0.0, 0.0, -0.5]),
    bias_id=st.sampled_from([-1, -1, -1, 3]),
    ban_active=st.sampled_from([False, False, True]),
    num_logprobs=st.sampled_from([-1, -1, 0, 5]),
))


@settings(max_examples=400, deadline=None)
@given(rows=st.lists(ROW, min_size=1, max_size=6), vocab=st.sampled_from([12, KC, 40, 300]))
def test_choose_variant_never_skips_a_needed_stage(rows, vocab):
    def column(name, dtype):
        return np.array([r[name] for r in rows], dtype)

    bias_ids = np.full((len(rows), 3), -1, np.int32)
    bias_ids[:, 1] = column("bias_id", np.int32)
    variant = choose_variant(
        column("temperature", np.float32), column("top_k", np.int32), column("top_p", np.float32),
        column("min_p", np.float32), column("repetition_penalty", np.float32),
        column("presence_penalty", np.float32), column("frequency_penalty", np.float32),
        bias_ids, column("ban_active", bool), column("num_logprobs", np.int32), vocab,
        num_candidates=KC)
    needed = set()
    for r in rows:
        needed |= needed_by_row(
            r["temperature"], r["top_k"], r["top_p"], r["min_p"],
            r["repetition_penalty"] != 1 or r["presence_penalty"] != 0
            or r["frequency_penalty"] != 0, r["bias_id"] >= 0, r["ban_active"],
            r["num_logprobs"], vocab)
    assert variant in SAMPLER_VARIANTS
    has = {s for s in STAGES if getattr(variant, s)}
    assert needed <= has, (needed, variant)
    cheaper = SAMPLER_VARIANTS[:SAMPLER_VARIANTS.index(variant)]
    assert not any(needed <= {s for s in STAGES if getattr(v, s)} for v in cheaper), needed
