"""``benchmarks/tp_memory.py``: the tensor-parallel step's layout and collectives, no GPU.

Llama-3-70B's shapes (abstract weights: nothing is allocated) over the four
simulated CPU devices of the test process (tests/conftest.py), compiled by
XLA's SPMD partitioner. What the split promises (jaxserve.model.sharding):
two all-reduces per layer (after the row-parallel o and down projections),
one for the vocabulary-split embedding lookup, one all-gather of the logits
for the sampler, nothing else — in particular no collective that gathers
the KV cache or a weight.
"""

from __future__ import annotations

import numpy as np

from benchmarks import tp_memory


def test_llama3_70b_at_tp4_has_two_all_reduces_per_layer():
    config = tp_memory.llama3_70b()
    out = tp_memory.analyse(config, tp=4, dtype="bfloat16", block_size=16, tokens=8, reqs=8,
                            max_model_len=256)
    none = dict.fromkeys(tp_memory.COLLECTIVES, 0)
    assert out["body_collectives_per_layer"] == {**none, "all-reduce": 2}
    assert out["body_collectives_fixed"] == {**none, "all-reduce": 1}
    assert out["sampler_collectives"] == {**none, "all-gather": 1}
    # Weights: every parameter's 1/4 except the replicated norms (exact count).
    params = (2 * 128256 * 8192 + 8192 + 80 * (8192 * (64 + 2 * 8) * 128 + 64 * 128 * 8192
                                               + 3 * 8192 * 28672 + 2 * 8192))
    norms = 8192 + 80 * 2 * 8192
    assert out["weight_bytes_per_device"] == 2 * ((params - norms) // 4 + norms)
    assert out["kv_bytes_per_block_per_device"] == 2 * 80 * (8 // 4) * 16 * 128 * 2


def test_count_collectives_counts_async_pairs_once():
    text = ("%a = all-reduce-start(x)\n%b = all-reduce-done(%a)\n%c = all-gather(y)\n"
            "%d = f32[] add(all-reduce-ish)")
    counts = tp_memory.count_collectives(text)
    assert counts["all-reduce"] == 1 and counts["all-gather"] == 1
    assert np.sum(list(counts.values())) == 2
