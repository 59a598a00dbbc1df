"""The GGUF metadata the conversion needs, and the Hugging Face config files made from it.

Key names follow the GGUF spec (ggml's ``docs/gguf.md``): ``{arch}.block_count``,
``{arch}.attention.head_count``, ``tokenizer.ggml.tokens``, ``tokenizer.chat_template``…
Only ``llama`` files with a ``gpt2`` (byte-level BPE) tokenizer are accepted —
what SmolLM2 is; anything else raises ``DemoModelError`` rather than guessing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxserve.demo import GENERATION_DEFAULTS, DemoModelError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


@dataclasses.dataclass(frozen=True, slots=True)
class GgufModelInfo:
    """Architecture and tokenizer facts of a llama GGUF file (see ``read_model_info``)."""

    name: str
    num_layers: int            # L
    hidden_size: int           # D
    intermediate_size: int     # MLP width
    num_heads: int             # N
    num_kv_heads: int          # K
    head_dim: int              # H
    vocab_size: int            # V
    context_length: int        # tokens
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool  # True when the file has no output.weight
    tokenizer_model: str       # "gpt2": byte-level BPE
    tokenizer_pre: str         # llama.cpp pre-tokenizer name, e.g. "smollm"
    tokens: tuple[str, ...]    # [V], in the byte-level alphabet
    token_types: tuple[int, ...]  # [V], TOKEN_TYPE_*
    merges: tuple[str, ...]    # "left right", best first
    bos_token_id: int
    eos_token_id: int
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def _float32_decimal(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(value)))


def read_model_info(reader: Any) -> GgufModelInfo:
    """Read a ``gguf.GGUFReader``'s metadata into a ``GgufModelInfo``.

    Raises ``DemoModelError`` for a non-llama architecture, a tokenizer other than
    byte-level BPE, partial rotary embeddings or a missing required key.
    """
    fields = reader.fields

    def get(key: str, default: Any = KeyError) -> Any:
        if key in fields:
            return fields[key].contents()
        if default is KeyError:
            raise DemoModelError(f"GGUF file lacks metadata key {key!r}")
        return default

    arch = get("general.architecture")
    if arch != "llama":
        raise DemoModelError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    tokenizer_model = get("tokenizer.ggml.model")
    if tokenizer_model != "gpt2":
        raise DemoModelError(f"GGUF tokenizer model {tokenizer_model!r} is not supported (only 'gpt2')")
    tokens = tuple(get("tokenizer.ggml.tokens"))
    hidden, heads = int(get("llama.embedding_length")), int(get("llama.attention.head_count"))
    head_dim = int(get("llama.attention.key_length", hidden // heads))
    rope_dims = int(get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise DemoModelError(f"partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    unk = get("tokenizer.ggml.unknown_token_id", None)
    pad = get("tokenizer.ggml.padding_token_id", None)
    return GgufModelInfo(
        name=str(get("general.name", "")),
        num_layers=int(get("llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(get("llama.feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(get("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=int(get("llama.vocab_size", len(tokens))),
        context_length=int(get("llama.context_length")),
        rope_theta=_float32_decimal(get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_float32_decimal(get("llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=not has_output,
        tokenizer_model=tokenizer_model,
        tokenizer_pre=str(get("tokenizer.ggml.pre", "default")),
        tokens=tokens,
        token_types=tuple(int(t) for t in get("tokenizer.ggml.token_type")),
        merges=tuple(get("tokenizer.ggml.merges")),
        bos_token_id=int(get("tokenizer.ggml.bos_token_id")),
        eos_token_id=int(get("tokenizer.ggml.eos_token_id")),
        unk_token_id=None if unk is None else int(unk),
        pad_token_id=None if pad is None else int(pad),
        add_bos_token=bool(get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(get("tokenizer.ggml.add_eos_token", False)),
        chat_template=get("tokenizer.chat_template", None),
    )


def hf_config(info: GgufModelInfo) -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM``, every field explicit.

    ``rope_theta`` / ``rope_scaling`` at the top level are what transformers 4.5x
    reads; ``rope_parameters`` is transformers 5.x's spelling of the same thing
    (5.x also converts the top-level keys itself), so both versions agree.
    """
    if len(info.tokens) != info.vocab_size:
        raise DemoModelError(f"GGUF vocabulary has {len(info.tokens)} tokens but vocab_size is {info.vocab_size}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": info.vocab_size,
        "hidden_size": info.hidden_size,
        "intermediate_size": info.intermediate_size,
        "num_hidden_layers": info.num_layers,
        "num_attention_heads": info.num_heads,
        "num_key_value_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": info.context_length,
        "initializer_range": 0.02,
        "rms_norm_eps": info.rms_norm_eps,
        "use_cache": True,
        "bos_token_id": info.bos_token_id,
        "eos_token_id": info.eos_token_id,
        "pad_token_id": info.pad_token_id,
        "tie_word_embeddings": info.tie_word_embeddings,
        "rope_theta": info.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": info.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "torch_dtype": "float32",
    }


def generation_config(info: GgufModelInfo) -> dict[str, Any]:
    """``generation_config.json``: the special token ids (generation stops at
    ``eos_token_id``) and the demo's sampling defaults (``jaxserve.demo.GENERATION_DEFAULTS``)."""
    return {
        "bos_token_id": info.bos_token_id,
        "eos_token_id": info.eos_token_id,
        "pad_token_id": info.pad_token_id,
        **GENERATION_DEFAULTS,
    }
