"""Small tokenizers built in the test (seconds, no download) for the api tests.

- ``byte_level_tokenizer()``: GPT-2 / Llama-3 / SmolLM2 style byte-level BPE.
  Trained on text with emoji, CJK and accented letters, so some tokens hold
  part of a character's UTF-8 bytes and characters split across tokens.
- ``llama2_style_tokenizer()``: SentencePiece-style BPE as in Llama 2's
  ``tokenizer.json``: ``▁`` for spaces (prepended to the text), byte-fallback
  tokens ``<0xNN>`` for characters outside the vocabulary, and a decoder that
  strips the text's leading space, so a token's text depends on whether it
  starts the text.

Both have the special tokens ``SPECIAL_TOKENS``.
"""

from __future__ import annotations

import functools
import json
import random

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "STOP", "stop",
         "hello", "world", "naïve", "café", "über", "fiancée", "señor", "données",
         "世界", "你好", "東京", "日本語", "한국어", "Ελληνικά", "Привет", "עברית",
         "😀", "🎉", "👍🏽", "🇫🇷", "👨‍👩‍👧", "🚀✨", "∑∫√", "—", "…", "!", "?", ",", "\n"]


def random_text(rng: random.Random, num_words: int) -> str:
    """Words from ``WORDS`` joined by single spaces (and sometimes none)."""
    parts = []
    for _ in range(num_words):
        parts.append(rng.choice(WORDS))
        parts.append(" " if rng.random() < 0.8 else "")
    return "".join(parts).strip(" ")


def _corpus(seed: int, lines: int) -> list[str]:
    rng = random.Random(seed)
    return [random_text(rng, rng.randrange(4, 16)) for _ in range(lines)]


@functools.cache
def byte_level_tokenizer() -> Tokenizer:
    """Byte-level BPE, vocabulary 420 (256 bytes + merges + 3 special tokens)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(0, 400), trainer)
    return tok


@functools.cache
def llama2_style_tokenizer() -> Tokenizer:
    """SentencePiece-style BPE with byte fallback; non-ASCII text becomes ``<0xNN>`` tokens."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  show_progress=False)
    ascii_corpus = ["".join(c for c in line if c.isascii()) for line in _corpus(1, 400)]
    tok.train_from_iterator(ascii_corpus, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok
