"""SamplingParams: defaults as vLLM, validation naming the field, hashability."""

from __future__ import annotations

import dataclasses
import math
import pickle
import subprocess
import sys

import pytest

from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.stop == () and p.stop_token_ids == () and p.logit_bias is None
    assert p.seed is None and not p.ignore_eos and not p.is_greedy
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.include_stop_str_in_output


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", -2), ("top_k", 2**31),  # int32 on the wire: larger reached the engine proto
    ("min_p", -0.01), ("min_p", 1.5),
    ("n", 0),
    ("max_tokens", 0),
    ("logprobs", MAX_LOGPROBS + 1), ("logprobs", -1),
    ("prompt_logprobs", 21),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("min_tokens", -1),
    ("temperature", math.nan), ("top_p", math.nan), ("min_p", math.inf),
    ("presence_penalty", math.inf), ("frequency_penalty", -math.inf),
    ("repetition_penalty", math.nan), ("temperature", math.inf),
    ("top_k", 2.5), ("n", True), ("seed", "7"),
    ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]), ("stop_token_ids", "abc"),
    ("ignore_eos", 1),
])
def test_invalid_value_names_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None


@pytest.mark.parametrize("bias", [{5: math.nan}, {5: math.inf}, {-1: 1.0}, {"x": 1.0}, [1, 2]])
def test_bad_logit_bias(bias):
    with pytest.raises(ValueError, match=r"^logit_bias"):
        SamplingParams(logit_bias=bias)


def test_boundaries_accepted():
    p = SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=1, logprobs=MAX_LOGPROBS,
                       prompt_logprobs=0, presence_penalty=-2, frequency_penalty=2)
    assert p.is_greedy and isinstance(p.temperature, float) and isinstance(p.top_p, float)


def test_normalization_and_hashable():
    p = SamplingParams(stop="###", stop_token_ids=[3, 4], logit_bias={"7": 1, 2: -0.5}, seed=-5)
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4)
    assert p.logit_bias == {7: 1.0, 2: -0.5} and isinstance(p.logit_bias, dict)
    q = SamplingParams(stop=["###"], stop_token_ids=(3, 4), logit_bias={2: -0.5, 7: 1.0}, seed=-5)
    assert p == q and hash(p) == hash(q) and len({p, q}) == 1
    with pytest.raises(TypeError):
        p.logit_bias[7] = 2.0  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


def test_caller_mutation_does_not_leak():
    bias = {1: 1.0}
    stops = ["a"]
    p = SamplingParams(logit_bias=bias, stop=stops)
    bias[2] = 3.0
    stops.append("b")
    assert p.logit_bias == {1: 1.0} and p.stop == ("a",)


def test_dict_and_pickle_round_trip():
    p = SamplingParams(n=2, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=1234,
                       stop=["\n\n"], stop_token_ids=[2], logprobs=5, logit_bias={10: 2.0},
                       min_tokens=3, max_tokens=100, repetition_penalty=1.1)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert pickle.loads(pickle.dumps(p)) == p
    assert isinstance(p.to_dict()["stop"], list)
    with pytest.raises(ValueError, match=r"^bogus"):
        SamplingParams.from_dict({"bogus": 1})


def test_all_stop_token_ids():
    p = SamplingParams(stop_token_ids=[5, 7])
    assert p.all_stop_token_ids((2, 5)) == (5, 7, 2)
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids((2,)) == (5,)


def test_no_jax_import():
    code = "import sys, jaxserve.sampling_params; assert 'jax' not in sys.modules; " \
           "assert 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
