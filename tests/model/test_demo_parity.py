"""The demo model in float32: greedy continuations equal transformers' token for token.

8 prompts (4 plain, 4 through the chat template), 32 greedy tokens each,
batched through the paged cache (one prefill step for all 8, then 31 batched
decode steps) against Hugging Face transformers' ``generate`` on PyTorch
(CPU, float32), one prompt at a time.
"""

import inspect

import numpy as np
import pytest
import torch
import transformers

from jaxserve.model.loader import load_model
from tests.model.paged_runner import PagedRunner

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
# transformers 5.x names the KV cache argument and output field ``cache``; the older
# ``past_key_values`` warns from 5.25 on and goes in 5.40.
CACHE = ("cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters
         else "past_key_values")
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three uses of a paperclip.",
]


@pytest.fixture(scope="module")
def prompts(demo_model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_model_dir)
    ids = [tokenizer(p)["input_ids"] for p in PLAIN]
    ids += [tokenizer.apply_chat_template([{"role": "user", "content": c}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for c in CHAT]
    return [list(map(int, x)) for x in ids]


def _transformers_greedy(model_dir, prompts):
    """Plain argmax decoding with transformers' KV cache (no logits processors, EOS not special)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            result = model(torch.tensor([ids]), use_cache=True)
            tokens = [int(result.logits[0, -1].argmax())]
            for _ in range(NEW_TOKENS - 1):
                result = model(torch.tensor([[tokens[-1]]]), use_cache=True,
                               **{CACHE: result[CACHE]})
                tokens.append(int(result.logits[0, -1].argmax()))
            out.append(tokens)
    return out


def test_greedy_continuations_match_transformers(demo_model_dir, prompts):
    expected = _transformers_greedy(demo_model_dir, prompts)
    config, graphdef, state = load_model(demo_model_dir, "float32")
    runner = PagedRunner(config, graphdef, state, block_size=16, num_blocks=8 * 6 + 1,
                         max_blocks=6, rows=8)
    names = [f"p{i}" for i in range(len(prompts))]
    logits = runner.step(dict(zip(names, prompts)))
    got = {n: [int(np.argmax(logits[n]))] for n in names}
    for _ in range(NEW_TOKENS - 1):
        logits = runner.step({n: [got[n][-1]] for n in names})
        for n in names:
            got[n].append(int(np.argmax(logits[n])))
    for i, n in enumerate(names):
        assert got[n] == expected[i], f"prompt {i}: {prompts[i][-8:]}"
