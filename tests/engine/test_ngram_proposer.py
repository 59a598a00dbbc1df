"""N-gram prompt lookup and ``SpeculativeConfig``, against hand-checked sequences."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine import SpeculativeConfig
from jaxserve.engine.ngram_proposer import propose_ngram


def _propose(tokens, k=3, low=1, high=3):
    return propose_ngram(np.array(tokens, np.int32), num_speculative_tokens=k,
                         prompt_lookup_min=low, prompt_lookup_max=high).tolist()


def test_the_longest_suffix_match_proposes_what_followed_it():
    # suffix (7, 8, 9) occurred at 0..2 (followed by 1, 2, 3); (8, 9) alone also at 5..6.
    assert _propose([7, 8, 9, 1, 2, 3, 8, 9, 4, 7, 8, 9]) == [1, 2, 3]
    # only the shorter (8, 9) matches: the latest of its occurrences wins.
    assert _propose([8, 9, 5, 6, 8, 9, 4, 0, 8, 9]) == [4, 0, 8]


def test_proposals_stop_at_k_and_at_the_sequence_end():
    assert _propose([1, 2, 3, 4, 5, 6, 1, 2], k=2) == [3, 4]
    assert _propose([5, 6, 5], k=4) == [6, 5]  # overlaps its own suffix


def test_no_proposal_below_prompt_lookup_min_or_without_a_match():
    assert _propose([1, 2, 3, 9, 3], low=2) == []  # only the 1-gram (3) matches
    assert _propose([1, 2, 3, 9, 3], low=1) == [9, 3]
    assert _propose([1, 2, 3, 4]) == []
    assert _propose([4]) == []


def test_speculative_config_defaults_and_errors_follow_vllm():
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (5, 5)
    one = SpeculativeConfig(prompt_lookup_max=4)
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                          "prompt_lookup_min": 2})
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (4, 2)
    with pytest.raises(ValueError, match="method must be one of ngram, draft_model, got 'eagle'"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max, got 3 and 2"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="unknown key.* draft_model"):
        SpeculativeConfig.from_dict({"draft_model": "x"})
    # vLLM: a model alone means a draft model; it needs the model, and only it does
    draft = SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 4})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/m", 4)
    with pytest.raises(ValueError, match="model .* is needed with method draft_model"):
        SpeculativeConfig.from_dict({"method": "draft_model"})
    with pytest.raises(ValueError, match="and only with it; got method 'ngram'"):
        SpeculativeConfig.from_dict({"method": "ngram", "model": "/m"})
    with pytest.raises(ValueError, match="model must be a directory path, got 3"):
        SpeculativeConfig.from_dict({"model": 3})
    with pytest.raises(ValueError, match="needs a method"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 3})


@pytest.mark.parametrize("field, value", [
    ("num_speculative_tokens", 2.5), ("num_speculative_tokens", "3"),
    ("num_speculative_tokens", None), ("num_speculative_tokens", True),
    ("prompt_lookup_max", 2.0), ("prompt_lookup_min", "1")])
def test_speculative_config_values_must_be_integers(field, value):
    with pytest.raises(ValueError, match=f"^speculative_config {field} must be an integer"):
        SpeculativeConfig.from_dict({"method": "ngram", field: value})


def test_llm_argument_is_none_a_config_or_a_dict():
    config = SpeculativeConfig(num_speculative_tokens=2)
    assert SpeculativeConfig.of(None) is None and SpeculativeConfig.of(config) is config
    assert SpeculativeConfig.of({"method": "ngram"}) == SpeculativeConfig()
    for bad in ('{"method": "ngram"}', "ngram", 3, [("method", "ngram")]):
        with pytest.raises(ValueError, match="must be a dict"):
            SpeculativeConfig.of(bad)
