"""The worker's host rows: the sampler variant cached per row equals ``choose_variant``.

``RowState.sampler_variant`` finds each row's stages once (when the row is
added) and only re-derives the min-tokens ban per step; the oracle is
``choose_variant`` over the same rows' parameters, rebuilt from scratch.
"""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import NewRow
from jaxserve.worker.rows import RowState
from jaxserve.worker.sampler import build_sampling_metadata, choose_variant

VOCAB = 300
EOS = (2,)

PARAMS = st.builds(
    dict,
    temperature=st.sampled_from([0.0, 0.7]),
    top_k=st.sampled_from([0, 5, 200]),
    top_p=st.sampled_from([1.0, 0.9]),
    min_p=st.sampled_from([0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.0, 1.2]),
    logit_bias=st.sampled_from([None, None, {7: 2.0}]),
    logprobs=st.sampled_from([None, None, 0, 3]),
    min_tokens=st.sampled_from([0, 3]),
    ignore_eos=st.booleans(),
    prompt_len=st.integers(1, 6),
    generated=st.integers(0, 4),
)


ONLY_BANNING = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                    logit_bias=None, logprobs=None, min_tokens=3, ignore_eos=False, prompt_len=2,
                    generated=1)  # greedy, but EOS is banned for two more tokens


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(PARAMS, min_size=1, max_size=5))
@example(rows=[ONLY_BANNING])
@example(rows=[{**ONLY_BANNING, "generated": 3}])  # the ban is over
def test_cached_choice_equals_choose_variant(rows):
    state = RowState(8, 64, 4, VOCAB, EOS)
    params = []
    for i, p in enumerate(rows):
        prompt_len, generated = p.pop("prompt_len"), p.pop("generated")
        sp = SamplingParams(max_tokens=16, **p)
        ids = np.arange(1, prompt_len + generated + 1, dtype=np.int32)
        state.add(NewRow(row=i, token_ids=ids, num_prompt_tokens=prompt_len, sampling_params=sp,
                         seed=None, block_ids=np.array([1 + i], np.int32)))
        params.append((sp, ids[:prompt_len].tolist(), ids[prompt_len:].tolist()))
    sample_rows = np.arange(len(rows), dtype=np.int32)
    md = build_sampling_metadata([p for p, _, _ in params],
                                 prompt_token_ids=[p for _, p, _ in params],
                                 output_token_ids=[o for _, _, o in params],
                                 vocab_size=VOCAB, eos_token_ids=EOS)
    ban = md.ban_active & (md.banned_ids >= 0).any(axis=1)
    want = choose_variant(md.temperature, md.top_k, md.top_p, md.min_p, md.repetition_penalty,
                          md.presence_penalty, md.frequency_penalty, md.logit_bias_ids, ban,
                          md.num_logprobs, VOCAB)
    assert state.sampler_variant(sample_rows) == want
