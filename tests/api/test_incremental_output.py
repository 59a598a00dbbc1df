"""IncrementalOutput: detokenization + stop strings per completion, as the api and LLM use it.

Oracle: the full decode of the output ids, cut by a brute-force stop-string
search (``test_stop_strings.reference``); stop strings are drawn from the
decoded text so that they span tokens and start inside tokens.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from jaxserve.api.detokenizer import REPLACEMENT_CHAR
from jaxserve.api.incremental_output import IncrementalOutput, OutputDelta
from jaxserve.sampling_params import SamplingParams
from tests.api.test_stop_strings import reference
from tests.api.tokenizer_cases import byte_level_tokenizer, random_text


def run(out: IncrementalOutput, ids: list[int], rng: random.Random,
        stop_token: bool = False) -> tuple[list[str], str | None]:
    """Pushes ids in random chunks; then flushes unless a stop string matched."""
    deltas, k = [], 0
    while k < len(ids):
        n = rng.randrange(1, 4)
        chunk = ids[k:k + n]
        k += n
        text, stop = out.push(chunk, stop_token=stop_token and k >= len(ids))
        deltas.append(text)
        if stop is not None:
            return deltas, stop
    text, stop = out.flush()
    deltas.append(text)
    return deltas, stop


@pytest.mark.parametrize("include", [False, True])
def test_random_stop_strings_match_reference(include):
    tok = byte_level_tokenizer()
    rng = random.Random(17 + include)
    for _ in range(200):
        prompt = tok.encode(random_text(rng, 3)).ids
        ids = tok.encode(random_text(rng, rng.randrange(2, 14))).ids
        full = tok.decode(ids)
        stops = []
        for _ in range(rng.randrange(1, 3)):
            start = rng.randrange(len(full))
            stops.append(full[start:start + rng.randrange(1, 8)])
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        out = IncrementalOutput(tok, prompt, params)
        deltas, stop = run(out, ids, rng)
        expected_text, expected_stop = reference(full, stops, include)
        assert ("".join(deltas), stop) == (expected_text, expected_stop), (full, stops)
        assert out.text == expected_text and out.stop_string == expected_stop and out.finished
        assert not any(REPLACEMENT_CHAR in d for d in deltas)
        if stop is not None:  # token ids end with the token that completed the stop string
            kept = out.token_ids
            assert kept == ids[:len(kept)]
            cut = len(expected_text) if include else len(expected_text) + len(stop)
            # The text streamed before the last kept token (tokens ending inside a
            # character only show text once it completes) ends before the cut.
            before = max(j for j in range(len(kept))
                         if not tok.decode(kept[:j]).endswith(REPLACEMENT_CHAR))
            assert len(tok.decode(kept)) >= cut > len(tok.decode(kept[:before]))
        else:
            assert out.token_ids == ids


def test_stop_string_starting_inside_a_token_demo(demo_model_dir):
    tok = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    text = "Hello 😀 世界 naïve 🇫🇷 done"
    ids = tok.encode(text).ids
    # "aï" starts inside the token " na" and ends inside the next token.
    assert not any(tok.decode([i]).endswith("a\u00ef") or tok.decode([i]) == "a\u00ef"
                   for i in ids)
    out = IncrementalOutput(tok, tok.encode("Say:").ids, SamplingParams(stop=["a\u00ef", "xyz"]))
    deltas = [out.push([i]) for i in ids]
    stops = [d.stop for d in deltas if d.stop]
    assert stops == ["a\u00ef"]
    assert "".join(d.text for d in deltas) == out.text == "Hello 😀 世界 n"
    assert tok.decode(out.token_ids).endswith("na\u00efve")
    assert out.push([ids[0]]) == OutputDelta("", None) and out.flush() == OutputDelta("", None)


def test_stop_token_text_left_out_unless_included():
    tok = byte_level_tokenizer()
    ids = tok.encode("hello world").ids
    stop_id = tok.encode(" STOP").ids
    assert len(stop_id) == 1
    for include in (False, True):
        out = IncrementalOutput(tok, [], SamplingParams(include_stop_str_in_output=include))
        texts = [out.push([i]).text for i in ids]
        texts.append(out.push(stop_id, stop_token=True).text)
        texts.append(out.flush().text)
        assert "".join(texts) == ("hello world STOP" if include else "hello world")
        assert out.token_ids == ids + stop_id  # the id is kept either way


def test_min_tokens_delays_stop_strings():
    tok = byte_level_tokenizer()
    first = tok.encode("the fox").ids
    ids = first + tok.encode(" the fox the dog").ids
    params = SamplingParams(stop=["fox"], min_tokens=len(first), max_tokens=20)
    out = IncrementalOutput(tok, [], params)
    deltas, stop = run(out, ids, random.Random(0))
    # The first "fox" ends within the first min_tokens tokens: ignored; the second one stops.
    assert stop == "fox" and "".join(deltas) == "the fox the "
    out = IncrementalOutput(tok, [], SamplingParams(stop=["fox"], min_tokens=len(first) - 1))
    deltas, stop = run(out, ids, random.Random(0))
    assert stop == "fox" and "".join(deltas) == out.text == "the "  # armed in time


def test_flush_releases_held_text_and_incomplete_character():
    tok = byte_level_tokenizer()
    ids = tok.encode("hello ST").ids
    out = IncrementalOutput(tok, [], SamplingParams(stop=["STOP"]))
    texts = [out.push([i]).text for i in ids]
    assert "".join(texts) == "hello "  # "ST" could begin "STOP"
    assert out.flush() == OutputDelta("ST", None)
    assert out.text == "hello ST" and out.stop_string is None
