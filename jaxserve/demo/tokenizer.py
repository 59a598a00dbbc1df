"""A standard Hugging Face fast tokenizer (``tokenizer.json`` + config) from GGUF tokenizer metadata.

GGUF's ``gpt2`` tokenizer model is byte-level BPE: the vocabulary is already
spelled in GPT-2's byte alphabet (``Ġ`` for a space) and the merges are
``"left right"`` strings, best first. The pre-tokenizer is named by
``tokenizer.ggml.pre``; llama.cpp's ``smollm`` splits every digit on its own
and then applies the GPT-2 regex, which is what the original SmolLM2
``tokenizer.json`` does with ``Digits(individual_digits=True)`` + ``ByteLevel``.
(transformers' own GGUF tokenizer loader ignores ``tokenizer.ggml.pre`` and
differs where a whitespace run or a space precedes a number: ``"  7"`` is
``["ĠĠ", "7"]`` for llama.cpp and here, ``["Ġ", "Ġ", "7"]`` there.)
Control tokens (GGUF token type 3) become special added tokens, so text such as
``<|im_start|>`` is matched whole; user-defined tokens (type 4) become plain
added tokens.
"""

from __future__ import annotations

from typing import Any

from jaxserve.demo import DemoModelError
from jaxserve.demo.gguf_read import TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, GgufModelInfo

# llama.cpp pre-tokenizer name -> split digits individually before the GPT-2 regex?
_PRE_TOKENIZERS = {"smollm": True, "gpt2": False, "default": False}


def build_tokenizer(info: GgufModelInfo) -> Any:
    """The ``tokenizers.Tokenizer`` for the GGUF vocabulary; token ids equal GGUF ids.

    Raises ``DemoModelError`` for an unknown pre-tokenizer, duplicate tokens or a
    malformed merge.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if info.tokenizer_pre not in _PRE_TOKENIZERS:
        raise DemoModelError(f"GGUF pre-tokenizer {info.tokenizer_pre!r} is not supported "
                             f"(known: {sorted(_PRE_TOKENIZERS)})")
    vocab = {token: index for index, token in enumerate(info.tokens)}
    if len(vocab) != len(info.tokens):
        raise DemoModelError("GGUF vocabulary has duplicate tokens")
    merges = []
    for merge in info.merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise DemoModelError(f"malformed GGUF merge {merge!r}")
        merges.append((parts[0], parts[1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _PRE_TOKENIZERS[info.tokenizer_pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(info.tokens, info.token_types) if kind == TOKEN_TYPE_CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(info.tokens, info.token_types) if kind == TOKEN_TYPE_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    for added in special + user:
        if tok.token_to_id(added.content) != vocab[added.content]:
            raise DemoModelError(f"added token {added.content!r} changed id")
    if tok.get_vocab_size(with_added_tokens=True) != info.vocab_size:
        raise DemoModelError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {info.vocab_size}")
    return tok


def _token(info: GgufModelInfo, token_id: int | None) -> str | None:
    return None if token_id is None else info.tokens[token_id]


def special_tokens_map(info: GgufModelInfo) -> dict[str, Any]:
    """``special_tokens_map.json``: bos/eos/unk/pad and the control tokens the chat template uses."""
    template = info.chat_template or ""
    extra = [t for t, kind in zip(info.tokens, info.token_types)
             if kind == TOKEN_TYPE_CONTROL and t in template]
    out: dict[str, Any] = {
        "bos_token": _token(info, info.bos_token_id),
        "eos_token": _token(info, info.eos_token_id),
        "unk_token": _token(info, info.unk_token_id),
        "pad_token": _token(info, info.pad_token_id),
        "additional_special_tokens": extra,
    }
    return {k: v for k, v in out.items() if v is not None}


def tokenizer_config(info: GgufModelInfo) -> dict[str, Any]:
    """``tokenizer_config.json`` for ``PreTrainedTokenizerFast`` (read alike by transformers 4.5x and 5.x).

    No BOS/EOS is added to encoded text (the GGUF's ``add_bos_token`` is false;
    the chat template writes the markers itself).
    """
    if info.add_bos_token or info.add_eos_token:
        raise DemoModelError("GGUF asks for BOS/EOS to be added; this converter's tokenizer adds none")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens_map(info),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": info.context_length,
    }
    if info.chat_template:
        config["chat_template"] = info.chat_template
    return config
