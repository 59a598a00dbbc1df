"""Seeds: a seeded request's tokens depend only on its seed and positions.

The same request (seed, parameters, a toy model whose logits depend on the
previous token, penalties on its own output) is decoded for several steps
alone (R = 1), at another row of a small batch, and inside a batch of 64
mixed requests; the token sequences must be identical.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.sampler import build_sampling_metadata, sample

VOCAB = 1000
STEPS = 12
PROMPT = [5, 17, 99, 3]
TABLE = np.random.default_rng(0).normal(0.0, 2.0, (VOCAB, VOCAB)).astype(np.float32)

TARGETS = [  # requests whose sequences are checked
    SamplingParams(seed=42, temperature=0.9, top_p=0.95, top_k=40, repetition_penalty=1.1,
                   frequency_penalty=0.2, max_tokens=STEPS),
    SamplingParams(seed=2**40 + 7, temperature=1.0, max_tokens=STEPS),  # unfiltered, 64-bit
    SamplingParams(seed=-3, min_p=0.1, temperature=1.3, top_p=0.9, max_tokens=STEPS),
]


def toy_logits(prev_token: int, step: int) -> np.ndarray:
    """f32[V]: logits of a deterministic toy model (previous token, step)."""
    return TABLE[prev_token] + np.float32(0.1 * step)


def random_request(rng: np.random.Generator) -> SamplingParams:
    kind = rng.integers(0, 4)
    seed = int(rng.integers(0, 2**31)) if rng.random() < 0.5 else None
    if kind == 0:
        return SamplingParams(temperature=0.0)
    if kind == 1:
        return SamplingParams(temperature=float(rng.uniform(0.3, 1.5)), seed=seed)
    return SamplingParams(temperature=float(rng.uniform(0.3, 1.5)), seed=seed,
                          top_k=int(rng.integers(1, 300)), top_p=float(rng.uniform(0.5, 1)),
                          presence_penalty=float(rng.uniform(0, 1)))


def decode(requests: list[SamplingParams | None], target_rows: tuple[int, ...],
           key_base: int) -> list[list[int]]:
    """Decodes STEPS tokens for every request in one batch of len(requests) rows.

    None marks a padding row. Rows in ``target_rows`` hold the targets (prompt
    PROMPT); returns their token sequences in that order.
    """
    rows = len(requests)
    rng = np.random.default_rng(key_base)
    live = [i for i, p in enumerate(requests) if p is not None]
    prompts = {i: PROMPT if i in target_rows else list(rng.integers(0, VOCAB, 6)) for i in live}
    outputs: dict[int, list[int]] = {i: [] for i in live}
    for step in range(STEPS):
        md = build_sampling_metadata(
            [requests[i] for i in live], prompt_token_ids=[prompts[i] for i in live],
            output_token_ids=[outputs[i] for i in live], vocab_size=VOCAB, num_rows=rows)
        # Builder rows are packed (live requests first, then padding): scatter
        # them to their batch rows; padding rows read the builder's padding row.
        slot = np.full(rows, len(live) if len(live) < rows else 0)
        slot[live] = np.arange(len(live))
        md = jax.tree_util.tree_map(lambda a: np.asarray(a)[slot], md)
        logits = np.random.default_rng(step).normal(size=(rows, VOCAB)).astype(np.float32)
        for i in live:
            logits[i] = toy_logits((outputs[i] or prompts[i])[-1], step)
        out = sample(logits, md, jax.random.fold_in(jax.random.key(key_base), step))
        for i in live:
            outputs[i].append(int(out.token_ids[i]))
    return [outputs[i] for i in target_rows]


def test_same_seed_same_tokens_alone_elsewhere_and_in_a_mixed_batch():
    alone = [decode([p], (0,), key_base=1)[0] for p in TARGETS]
    for seq in alone:
        assert len(set(seq)) > 3  # really random, not stuck

    # At other rows of an 8-row batch, with padding rows in between.
    rng = np.random.default_rng(5)
    small: list[SamplingParams | None] = [None] * 8
    rows = (6, 2, 4)
    for row, p in zip(rows, TARGETS):
        small[row] = p
    small[0], small[7] = random_request(rng), random_request(rng)
    assert decode(small, rows, key_base=2) == alone

    # Inside 64 mixed requests.
    batch: list[SamplingParams | None] = [random_request(rng) for _ in range(64)]
    rows = (63, 17, 40)
    for row, p in zip(rows, TARGETS):
        batch[row] = p
    assert decode(batch, rows, key_base=3) == alone


def test_different_seed_or_unseeded_rows_differ():
    base = TARGETS[1]
    alone = decode([base], (0,), key_base=1)[0]
    other = decode([SamplingParams(seed=base.seed + 1, temperature=1.0)], (0,), key_base=1)[0]
    assert other != alone
    # 64 identical unseeded rows at the same position draw independently.
    logits = np.tile(toy_logits(3, 0) / 8, (64, 1))
    md = build_sampling_metadata([SamplingParams()] * 64, prompt_token_ids=[PROMPT] * 64,
                                 output_token_ids=[[]] * 64, vocab_size=VOCAB)
    tokens = np.asarray(sample(logits, md, jax.random.key(9)).token_ids)
    assert len(set(tokens.tolist())) > 32


def test_raw_and_typed_server_keys_agree():
    logits = np.tile(toy_logits(3, 0), (4, 1))
    md = build_sampling_metadata([SamplingParams()] * 4, prompt_token_ids=[PROMPT] * 4,
                                 output_token_ids=[[]] * 4, vocab_size=VOCAB)
    key = jax.random.key(5)
    typed = sample(logits, md, key).token_ids
    raw = sample(logits, md, jax.random.key_data(key)).token_ids
    np.testing.assert_array_equal(typed, raw)
