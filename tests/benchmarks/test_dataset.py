"""The ShareGPT-like workload: ranges, determinism, the long tail."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.dataset import fixed_lengths, sharegpt_like


def test_lengths_in_range_ids_in_vocab_and_seeded():
    a = sharegpt_like(400, 49152, seed=3)
    b = sharegpt_like(400, 49152, seed=3)
    c = sharegpt_like(400, 49152, seed=4)
    assert a == b and a != c
    ins, outs = np.array(a.input_lens), np.array(a.output_lens)
    assert ins.min() >= 32 and ins.max() <= 1024 and outs.min() >= 32 and outs.max() <= 512
    ids = np.concatenate([np.array(p) for p in a.prompts])
    assert ids.min() >= 100 and ids.max() < 49152
    # long-tailed: the mean sits above the median, and both ends of the range are reached
    assert ins.mean() > np.median(ins) and outs.mean() > np.median(outs)
    assert (ins == 1024).any() and (ins == 32).any()
    assert a.num_output_tokens == outs.sum() and a.num_prompt_tokens == ins.sum()
    assert a.summary()["input_len"]["max"] == ins.max()


def test_fixed_lengths_and_small_vocab():
    w = fixed_lengths(5, 150, 7, 3, seed=1)
    assert w.input_lens == (7,) * 5 and w.output_lens == (3,) * 5
    assert max(max(p) for p in w.prompts) < 150  # V <= 200: ids drawn from [0, V)


@pytest.mark.parametrize("kwargs", [dict(num_requests=0), dict(input_range=(0, 5)),
                                    dict(output_range=(9, 4))])
def test_bad_arguments(kwargs):
    args = dict(num_requests=3, vocab_size=1000) | kwargs
    with pytest.raises(ValueError):
        sharegpt_like(**args)
