"""The paged cache is invisible to the maths.

- The same sequence with block sizes 1, 16 and 32 gives the logits that a
  contiguous cache (one block holding the whole sequence) gives.
- Ragged prompts in one mixed call (with padding tokens and padding rows)
  give the logits each prompt gets alone.
- A prefill continuing after cached blocks (chunked prefill) equals one
  unchunked prefill.
Bound: 5e-5 absolute on logits of magnitude ~10 (float32; XLA blocks the
matrix products differently for different row counts, so summation order
differs; observed up to 1.5e-5).
"""

import numpy as np
import pytest

from jaxserve.model.loader import load_model
from tests.model.hf_tiny import make_tiny_model
from tests.model.paged_runner import PagedRunner

TOL = 5e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_model("LlamaForCausalLM", directory, seed=3)
    return load_model(directory, "float32")


def _run_sequence(model, tokens, block_size, prompt_len):
    config, graphdef, state = model
    max_blocks = -(-len(tokens) // block_size)
    runner = PagedRunner(config, graphdef, state, block_size=block_size,
                         num_blocks=max_blocks + 1 + 3, max_blocks=max_blocks, seed=block_size)
    out = [runner.step({"s": tokens[:prompt_len]}, all_logits=True)["s"]]
    out += [runner.step({"s": [t]})["s"][None] for t in tokens[prompt_len:]]
    return np.concatenate(out)


def test_block_sizes_equal_contiguous(model):
    tokens = np.random.default_rng(0).integers(0, 256, 45).tolist()
    contiguous = _run_sequence(model, tokens, block_size=64, prompt_len=33)  # one block
    for block_size in (1, 16, 32):
        paged = _run_sequence(model, tokens, block_size=block_size, prompt_len=33)
        np.testing.assert_allclose(paged, contiguous, atol=TOL, rtol=0,
                                   err_msg=f"block_size={block_size}")


def test_ragged_batch_equals_each_prompt_alone(model):
    config, graphdef, state = model
    rng = np.random.default_rng(1)
    prompts = {f"p{i}": rng.integers(0, 256, n).tolist() for i, n in enumerate([1, 16, 23, 40])}
    alone = {}
    for name, toks in prompts.items():
        runner = PagedRunner(config, graphdef, state, block_size=16, num_blocks=24, max_blocks=4)
        alone[name] = runner.step({name: toks}, all_logits=True)[name]
        alone[name + "/decode"] = runner.step({name: [5]})[name]
    runner = PagedRunner(config, graphdef, state, block_size=16, num_blocks=24, max_blocks=4,
                         rows=6, seed=11)
    mixed = runner.step(prompts, pad_tokens=8, all_logits=True)
    # Then one mixed decode step for all four rows, with padding tokens again.
    decode = runner.step({name: [5] for name in prompts}, pad_tokens=3)
    for name in prompts:
        np.testing.assert_allclose(mixed[name], alone[name], atol=TOL, rtol=0, err_msg=name)
        np.testing.assert_allclose(decode[name], alone[name + "/decode"], atol=TOL, rtol=0,
                                   err_msg=name + " decode")


@pytest.mark.parametrize("chunks", [(16, 16, 8), (48, 1), (5, 30, 5)])
def test_chunked_prefill_equals_one_prefill(model, chunks):
    config, graphdef, state = model
    tokens = np.random.default_rng(2).integers(0, 256, sum(chunks)).tolist()
    whole = PagedRunner(config, graphdef, state).step({"s": tokens}, all_logits=True)["s"]
    runner = PagedRunner(config, graphdef, state, seed=5)
    parts, start = [], 0
    for n in chunks:
        # A decode-like neighbour row shares every step with the chunks.
        parts.append(runner.step({"s": tokens[start:start + n], "other": [3]}, all_logits=True)["s"])
        start += n
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=TOL, rtol=0)
