"""IncrementalDetokenizer: deltas are whole characters and concatenate to the full decode.

Oracles: the tokenizer's own full ``decode`` of the output ids (byte-level
tokenizers), or of prompt + output minus the prompt's decode (the Llama-2
style tokenizer, whose decoder strips the text's leading space); and, for the
demo model, Hugging Face transformers' ``decode``. Tokenizers: built in the
test (``tokenizer_cases``) and the demo model's (``demo_model_dir`` fixture).
"""

from __future__ import annotations

import logging
import random

import pytest
from tokenizers import Tokenizer, decoders, models

from jaxserve.api.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, backend_tokenizer
from tests.api.tokenizer_cases import (SPECIAL_TOKENS, byte_level_tokenizer,
                                       llama2_style_tokenizer, random_text)


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))


def _tokenizer(kind: str, request: pytest.FixtureRequest) -> Tokenizer:
    if kind == "demo":
        return request.getfixturevalue("demo_tokenizer")
    return {"byte_level": byte_level_tokenizer, "llama2_style": llama2_style_tokenizer}[kind]()


def in_context(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> str:
    """The output's text as it reads after the prompt."""
    base = tok.decode(prompt, skip_special_tokens=skip)
    full = tok.decode(prompt + output, skip_special_tokens=skip)
    assert full.startswith(base)
    return full[len(base):]


def stream(tok, prompt, output, skip=True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.step(t) for t in output]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    assert detok.output_token_ids == list(output)
    return deltas


@pytest.mark.parametrize("kind", ["byte_level", "llama2_style", "demo"])
def test_deltas_are_whole_characters_and_concatenate_to_decode(kind, request):
    tok = _tokenizer(kind, request)
    rng = random.Random(sum(map(ord, kind)))  # seeded per tokenizer
    for _ in range(150):
        prompt = tok.encode(random_text(rng, rng.randrange(1, 6))).ids
        output = tok.encode(random_text(rng, rng.randrange(1, 12))).ids
        deltas = stream(tok, prompt, output)
        assert not any(REPLACEMENT_CHAR in d for d in deltas)
        expected = in_context(tok, prompt, output)
        assert "".join(deltas) == expected
        if kind != "llama2_style":  # byte-level: the plain decode of the output ids
            assert expected == tok.decode(output)


@pytest.mark.parametrize("kind", ["byte_level", "demo"])
def test_text_is_emitted_when_a_token_ends_a_character(kind, request):
    tok = _tokenizer(kind, request)
    rng = random.Random(3)
    for _ in range(100):
        output = tok.encode(random_text(rng, rng.randrange(1, 10))).ids
        detok = IncrementalDetokenizer(tok, tok.encode("Say:").ids)
        for k, token_id in enumerate(output, start=1):
            detok.step(token_id)
            so_far = tok.decode(output[:k])
            if so_far.endswith(REPLACEMENT_CHAR):  # held back: this token's text
                assert so_far.startswith(detok.text)
            else:  # nothing held back once a token ends on a character boundary
                assert detok.text == so_far


def test_character_split_across_tokens_demo(demo_tokenizer):
    tok = demo_tokenizer
    for text in ["😀", " 世界", "🇫🇷", " 👨‍👩‍👧", "日本語"]:
        output = tok.encode(text).ids
        assert len(output) > 1, f"{text!r} is a single token; pick a split character"
        deltas = stream(tok, tok.encode("Hi").ids, output)
        assert "".join(deltas) == text == tok.decode(output)
        assert not any(REPLACEMENT_CHAR in d for d in deltas)
        assert "" in deltas[:-1]  # some token ended mid-character


@pytest.mark.parametrize("kind", ["byte_level", "demo"])
def test_random_token_ids_concatenate_to_decode(kind, request):
    """Any id sequence, invalid UTF-8 included: the text equals the full decode."""
    tok = _tokenizer(kind, request)
    vocab = tok.get_vocab_size()
    partial = [i for i in range(vocab) if REPLACEMENT_CHAR in tok.decode([i])]
    rng = random.Random(11)
    for _ in range(300):
        skip = rng.random() < 0.5
        output = [rng.choice(partial) if rng.random() < 0.6 else rng.randrange(vocab)
                  for _ in range(rng.randrange(1, 14))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
        assert "".join(stream(tok, prompt, output, skip)) == tok.decode(
            output, skip_special_tokens=skip)


@pytest.mark.parametrize("kind", ["byte_level", "llama2_style"])
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(kind, skip, request):
    tok = _tokenizer(kind, request)
    special = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    rng = random.Random(5)
    for _ in range(60):
        output = tok.encode(random_text(rng, 6)).ids
        # Between whole characters (see test_byte_fallback_run_broken_by_special_token).
        bounds = [k for k in range(len(output) + 1)
                  if not tok.decode(output[:k]).endswith(REPLACEMENT_CHAR)]
        for k in sorted(rng.sample(bounds, min(len(bounds), rng.randrange(1, 4))), reverse=True):
            output.insert(k, rng.choice(special))
        prompt = tok.encode("a").ids + [rng.choice(special)]
        text = "".join(stream(tok, prompt, output, skip))
        assert text == in_context(tok, prompt, output, skip)
        assert any(t in text for t in SPECIAL_TOKENS) != skip


def test_prompt_context_keeps_first_leading_space():
    tok = llama2_style_tokenizer()
    prompt = tok.encode("the quick").ids
    output = tok.encode("brown fox").ids  # "▁brown", ...: a word that follows a space
    assert not tok.decode(output).startswith(" ")  # alone, the leading space is stripped
    assert "".join(stream(tok, prompt, output)) == " brown fox"
    assert "".join(stream(tok, [], output)) == "brown fox"  # no prompt: starts the text


def _split_character_ids(tok: Tokenizer) -> list[int]:
    """Ids of a short text in which some token ends inside a character."""
    for text in [" 🎉", " 😀", " 世界", " 🚀✨", " 👍🏽"]:
        ids = tok.encode(text).ids
        if any(REPLACEMENT_CHAR in tok.decode(ids[:k]) for k in range(1, len(ids))):
            return ids
    raise AssertionError("no split character in the test texts")


def test_prompt_ending_mid_character_is_not_emitted():
    tok = byte_level_tokenizer()
    ids = tok.encode("hello").ids + _split_character_ids(tok) + tok.encode(" world").ids
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(REPLACEMENT_CHAR))
    deltas = stream(tok, ids[:cut], ids[cut:])
    assert "hello" not in "".join(deltas)
    assert "".join(deltas) == tok.decode(ids[cut:])


def test_flush_emits_incomplete_character_once():
    tok = byte_level_tokenizer()
    ids = _split_character_ids(tok)
    ids = ids[:next(k for k in range(1, len(ids))
                    if tok.decode(ids[:k]).endswith(REPLACEMENT_CHAR))]
    detok = IncrementalDetokenizer(tok, tok.encode("hi").ids)
    steps = [detok.step(t) for t in ids]
    assert steps[-1] == "" and not any(REPLACEMENT_CHAR in d for d in steps)
    rest = detok.flush()
    assert detok.text == tok.decode(ids) and rest.endswith(REPLACEMENT_CHAR)
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.step(ids[-1])


def test_byte_fallback_run_broken_by_special_token(caplog):
    """Llama-2 style decoders turn a byte run that a special token interrupts into one
    U+FFFD per byte, retroactively, so the full decode rewrites text already
    streamed. The stream cannot take text back: it must not crash, keeps what it
    sent, and goes on."""
    tok = llama2_style_tokenizer()
    ids = tok.encode("hello 👨‍👩").ids
    runs = [i for i, t in enumerate(ids) if tok.id_to_token(t) == "<0xF0>"]
    eot = tok.token_to_id("<|endoftext|>")
    output = ids[:runs[1] + 1] + [eot] + ids[runs[1] + 1:]  # "hello 👨‍" <0xF0> <eot> ...
    with caplog.at_level(logging.WARNING, logger="jaxserve.api.detokenizer"):
        deltas = stream(tok, tok.encode("a").ids, output, skip=False)
    text = "".join(deltas)
    assert text.startswith(" hello 👨\u200d") and "<|endoftext|>" in text
    assert "re-priming" in caplog.text


class _CapitalizeInPairs:
    """A decoder that is not monotonic: "Z" capitalizes the previous token, but only
    when decoding exactly two tokens (as DecodeStream's short window does)."""

    def decode_chain(self, tokens):
        out = list(tokens)
        if len(tokens) == 2 and tokens[1] == "Z":
            out[0] = out[0].upper()
        return out


class _CapitalizeAlways:
    def decode_chain(self, tokens):
        return [t.upper() if i + 1 < len(tokens) and tokens[i + 1] == "Z" else t
                for i, t in enumerate(tokens)]


def _word_tokenizer(decoder) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "Z": 2}, unk_token="a"))
    tok.decoder = decoders.Decoder.custom(decoder)
    return tok


def test_recovers_when_decode_stream_loses_its_prefix(caplog):
    tok = _word_tokenizer(_CapitalizeInPairs())
    output = [0, 1, 0, 2, 1]
    with caplog.at_level(logging.WARNING, logger="jaxserve.api.detokenizer"):
        text = "".join(stream(tok, [], output))
    assert "re-priming" in caplog.text
    assert text == tok.decode(output) == "abaZb"


def test_recovery_without_context_when_the_decoder_never_agrees(caplog):
    tok = _word_tokenizer(_CapitalizeAlways())
    with caplog.at_level(logging.WARNING, logger="jaxserve.api.detokenizer"):
        deltas = stream(tok, [], [0, 1, 0, 2, 1])
    assert "re-priming" in caplog.text
    assert "".join(deltas) == "abaZb"  # no crash; the capital is lost (already emitted)


def test_accepts_hf_fast_tokenizer_and_rejects_others():
    from transformers import PreTrainedTokenizerFast

    tok = byte_level_tokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert backend_tokenizer(hf) is hf.backend_tokenizer
    ids = tok.encode("naïve 世界 🎉").ids
    assert "".join(stream(hf, [], ids)) == hf.decode(ids)
    with pytest.raises(TypeError, match="fast tokenizer"):
        IncrementalDetokenizer(object())


def test_demo_model_matches_transformers_decode(demo_model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(demo_model_dir)
    prompt = hf.apply_chat_template([{"role": "user", "content": "Say hi in Japanese"}],
                                    add_generation_prompt=True, tokenize=True)
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):  # a BatchEncoding
        prompt = prompt["input_ids"]
    rng = random.Random(2)
    for _ in range(40):
        output = hf.encode(random_text(rng, rng.randrange(1, 12)), add_special_tokens=False)
        output.append(hf.eos_token_id)
        for skip in (True, False):
            deltas = stream(hf, prompt, output, skip)
            assert "".join(deltas) == hf.decode(output, skip_special_tokens=skip)
            assert not any(REPLACEMENT_CHAR in d for d in deltas)
