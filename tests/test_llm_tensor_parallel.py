"""``jaxserve.LLM(tensor_parallel_size=N)``: the same tokens as one device.

A tiny random-weight Llama with 8 query heads and 2 KV heads
(the test process has four simulated CPU devices, tests/conftest.py): TP = 2
splits the KV heads, TP = 4 replicates each on two devices. Greedy and
seeded-sampling outputs of TP = 2 and TP = 4 equal TP = 1 token for token,
with no compile after warm-up (strict recompile). Prompts are token ids (the
demo model's tokenizer only detokenizes; the tiny vocabulary is 256).

``jaxserve save-checkpoint -tp 2`` converts the same model once into an Orbax
parameter checkpoint directory; an LLM with TP = 2 on that directory restores
it and gives the same tokens again.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.model.hf_tiny import make_tiny_model

HEADS = dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7, max_tokens=12,
                         ignore_eos=True, repetition_penalty=1.1, logprobs=2)]


def _outputs(model_dir, tokenizer_dir, prompts, tensor_parallel_size, speculative_config=None,
             stats=None):
    """Tokens and logprobs of ``prompts`` under each of ``PARAMS``; the engine's final
    ``EngineStats`` is appended to ``stats`` when given."""
    with LLM(str(model_dir), tokenizer=str(tokenizer_dir), max_num_seqs=4,
             max_num_batched_tokens=32, max_model_len=128, strict_recompile=True,
             token_buckets=(8, 32), request_buckets=(4,),
             tensor_parallel_size=tensor_parallel_size,
             speculative_config=speculative_config) as llm:
        out = [[o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
               for params in PARAMS]
        if stats is not None:
            stats.append(llm.engine.stats())
    return ([[c.token_ids for c in batch] for batch in out],
            [[lp for c in batch for lp in (c.logprobs or [])] for batch in out])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, demo_model_dir):
    """(tiny model directory, prompts, TP = 1 tokens and logprobs)."""
    directory = tmp_path_factory.mktemp("tiny_tp")
    make_tiny_model("LlamaForCausalLM", directory, **HEADS)
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.integers(1, 256, n).tolist()} for n in (5, 19, 40)]
    return (directory, prompts) + _outputs(directory, demo_model_dir, prompts, 1)


def test_tensor_parallel_llm_matches_one_device(tiny, demo_model_dir):
    directory, prompts, want, want_logprobs = tiny
    stats = []
    # With speculative decoding too: the verify step is replicated like the sampler,
    # and a draft model (here the model itself) is split over the mesh like the target.
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    draft = {"model": str(directory), "num_speculative_tokens": 2}
    for tp, speculative_config in ((2, spec), (4, draft)):
        got, logprobs = _outputs(directory, demo_model_dir, prompts, tp, speculative_config,
                                 stats)
        assert got == want, f"TP={tp}"
        # The sampled tokens' logprobs agree to float32 round-off.
        for a, b in zip(logprobs[1], want_logprobs[1]):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert stats[0].spec_decode_num_draft_tokens > 0
    assert stats[1].spec_decode_num_accepted_tokens > 0


def test_a_saved_checkpoint_gives_the_same_tokens(tiny, demo_model_dir, tmp_path):
    directory, prompts, want, _ = tiny
    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-m", "jaxserve", "save-checkpoint", "--model",
                           str(directory), "--output", str(out), "-tp", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not list(out.glob("*.safetensors")) and (out / "jaxserve_checkpoint.json").is_file()
    got, _ = _outputs(out, demo_model_dir, prompts, 2)
    assert got == want
    # A second save into it is refused unless --force (the command says why, in one line).
    again = subprocess.run([sys.executable, "-m", "jaxserve", "save-checkpoint", "--model",
                            str(directory), "--output", str(out), "-tp", "2"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert "force" in again.stderr


def test_a_model_that_does_not_split_is_refused(demo_model_dir):
    # The demo model has 9 query heads and 3 KV heads: TP = 2 fits neither.
    with pytest.raises(ValueError, match="9 query heads do not split evenly over 2 devices"):
        LLM(str(demo_model_dir), tensor_parallel_size=2, max_num_seqs=1,
            max_num_batched_tokens=16)
