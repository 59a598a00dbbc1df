"""``jaxserve.LLM(tensor_parallel_size=N)``: the same tokens as one device.

A tiny random-weight Llama with 8 query heads and 2 KV heads
(the test process has four simulated CPU devices, tests/conftest.py): TP = 2
splits the KV heads, TP = 4 replicates each on two devices. Greedy and
seeded-sampling outputs of TP = 2 and TP = 4 equal TP = 1 token for token,
with no compile after warm-up (strict recompile). Prompts are token ids (the
demo model's tokenizer only detokenizes; the tiny vocabulary is 256).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.model.hf_tiny import make_tiny_model

HEADS = dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7, max_tokens=12,
                         ignore_eos=True, repetition_penalty=1.1, logprobs=2)]


def _outputs(model_dir, tokenizer_dir, prompts, tensor_parallel_size):
    with LLM(str(model_dir), tokenizer=str(tokenizer_dir), max_num_seqs=4,
             max_num_batched_tokens=32, max_model_len=128, strict_recompile=True,
             token_buckets=(8, 32), request_buckets=(4,),
             tensor_parallel_size=tensor_parallel_size) as llm:
        out = [[o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
               for params in PARAMS]
    return ([[c.token_ids for c in batch] for batch in out],
            [[lp for c in batch for lp in (c.logprobs or [])] for batch in out])


def test_tensor_parallel_llm_matches_one_device(tmp_path, demo_model_dir):
    make_tiny_model("LlamaForCausalLM", tmp_path, **HEADS)
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.integers(1, 256, n).tolist()} for n in (5, 19, 40)]
    want, want_logprobs = _outputs(tmp_path, demo_model_dir, prompts, 1)
    for tp in (2, 4):
        got, logprobs = _outputs(tmp_path, demo_model_dir, prompts, tp)
        assert got == want, f"TP={tp}"
        # The sampled tokens' logprobs agree to float32 round-off.
        for a, b in zip(logprobs[1], want_logprobs[1]):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_a_model_that_does_not_split_is_refused(demo_model_dir):
    # The demo model has 9 query heads and 3 KV heads: TP = 2 fits neither.
    with pytest.raises(ValueError, match="9 query heads do not split evenly over 2 devices"):
        LLM(str(demo_model_dir), tensor_parallel_size=2, max_num_seqs=1,
            max_num_batched_tokens=16)
