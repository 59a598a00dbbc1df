"""A tiny random-weight Llama directory with a tokenizer, for the benchmark smoke tests."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_model_dir: pathlib.Path) -> pathlib.Path:
    """tests/model/hf_tiny's Llama (V = 256, 2 layers) plus the demo model's tokenizer files.

    The tokenizer's vocabulary is larger than the model's; the benchmarks
    send token ids below V and only detokenize what the model generates.
    """
    from tests.model.hf_tiny import copy_tokenizer, make_tiny_model

    directory = tmp_path_factory.mktemp("tiny_llama_tok")
    make_tiny_model("LlamaForCausalLM", directory)
    return copy_tokenizer(demo_model_dir, directory)
