"""Default sampling parameters from ``generation_config.json`` (``jaxserve.generation_config``).

Real files in temporary directories: which fields become defaults, the
``auto`` / ``vllm`` / directory sources, errors naming the file and the
field; and ``jaxserve.LLM`` using them when ``generate`` gets no
``SamplingParams`` (a tiny random Llama, the demo tokenizer), explicit
parameters winning. The server's merge is tested in
``tests/api/test_server_units.py``.
"""

from __future__ import annotations

import argparse
import json

import pytest

from jaxserve.generation_config import generation_config_source, load_sampling_defaults
from jaxserve.sampling_params import SamplingParams

FILE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "num_beams": 1,
        "temperature": 0.3, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 40}


def _write(directory, config):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_sampling_fields_become_defaults_and_the_rest_is_ignored(tmp_path):
    model = _write(tmp_path / "model", FILE)
    assert load_sampling_defaults(model) == {
        "temperature": 0.3, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_tokens": 40}


def test_do_sample_false_is_not_consulted_as_in_vllm(tmp_path):
    model = _write(tmp_path / "model", {"do_sample": False, "temperature": 0.6})
    assert load_sampling_defaults(model) == {"temperature": 0.6}


def test_sources(tmp_path):
    model = _write(tmp_path / "model", FILE)
    other = _write(tmp_path / "other", {"temperature": 0.9})
    assert load_sampling_defaults(model, "vllm") == {}
    assert load_sampling_defaults(model, str(other)) == {"temperature": 0.9}
    assert load_sampling_defaults(tmp_path / "no_file") == {}  # auto without a file: none
    with pytest.raises(FileNotFoundError, match="no generation_config.json"):
        load_sampling_defaults(model, str(tmp_path / "no_file"))
    assert generation_config_source("auto") == "auto"
    assert generation_config_source(str(other)) == str(other)
    with pytest.raises(argparse.ArgumentTypeError, match="auto, vllm or a directory"):
        generation_config_source("Auto")


def test_a_value_sampling_params_rejects_names_the_file_and_the_field(tmp_path):
    model = _write(tmp_path / "model", {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"generation_config.json: top_p"):
        load_sampling_defaults(model)
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        load_sampling_defaults(model)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.model.hf_tiny import make_tiny_model

    directory = tmp_path_factory.mktemp("tiny_generation_config")
    make_tiny_model("LlamaForCausalLM", directory, seed=3)
    _write(directory, {"temperature": 0.5, "top_k": 7, "max_new_tokens": 3})
    return directory


def test_llm_uses_the_file_when_generate_gets_no_params(tiny_dir, demo_model_dir):
    from jaxserve import LLM

    with LLM(str(tiny_dir), tokenizer=str(demo_model_dir), max_model_len=64, max_num_seqs=2,
             max_num_batched_tokens=16, block_size=4, num_kv_blocks=64,
             token_buckets=(1, 2, 16), request_buckets=(1, 2)) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.5, top_k=7,
                                                                   max_tokens=3)
        (default,) = llm.generate([[5, 6, 7, 8]], use_tqdm=False)
        assert len(default.outputs[0].token_ids) == 3  # not the 60 tokens of room left
        assert default.outputs[0].finish_reason == "length"
        (explicit,) = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True),
                                   use_tqdm=False)
        assert len(explicit.outputs[0].token_ids) == 6
