"""A tiny random-weight Llama directory with a tokenizer, for the benchmark smoke tests."""

from __future__ import annotations

import pathlib
import shutil

import pytest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_model_dir: pathlib.Path) -> pathlib.Path:
    """tests/model/hf_tiny's Llama (V = 256, 2 layers) plus the demo model's tokenizer files.

    The tokenizer's vocabulary is larger than the model's; the benchmarks
    send token ids below V and only detokenize what the model generates.
    """
    from tests.model.hf_tiny import make_tiny_model

    directory = tmp_path_factory.mktemp("tiny_llama_tok")
    make_tiny_model("LlamaForCausalLM", directory)
    for name in TOKENIZER_FILES:
        if (demo_model_dir / name).exists():
            shutil.copy(demo_model_dir / name, directory / name)
    return directory
