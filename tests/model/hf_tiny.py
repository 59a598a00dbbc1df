"""Test helper: tiny random-weight Hugging Face models of each supported architecture."""

from __future__ import annotations

import pathlib
import shutil

import torch
import transformers

# Small enough to run in a fraction of a second, irregular enough to catch
# layout mistakes: GQA ratio 3 (like the demo model), head_dim != D / N for Qwen3.
TINY = dict(vocab_size=256, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, initializer_range=0.2)

# The tokenizer files a model directory needs (copied from the demo model).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

ARCHS = {
    "LlamaForCausalLM": (transformers.LlamaConfig, dict(
        tie_word_embeddings=False, rope_theta=10000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16))),
    "MistralForCausalLM": (transformers.MistralConfig, dict(
        tie_word_embeddings=False, sliding_window=16, head_dim=16, rope_theta=10000.0)),
    "Qwen2ForCausalLM": (transformers.Qwen2Config, dict(
        tie_word_embeddings=True, use_sliding_window=False, rope_theta=1000000.0)),
    "Qwen3ForCausalLM": (transformers.Qwen3Config, dict(
        tie_word_embeddings=True, head_dim=32, use_sliding_window=False, rope_theta=1000000.0)),
}


def make_tiny_model(arch: str, directory: pathlib.Path, seed: int = 0,
                    **overrides) -> transformers.PreTrainedModel:
    """Saves a random-weight model of ``arch`` to ``directory`` (safetensors) and returns it.

    ``overrides``: config fields replacing ``TINY``'s and the architecture's.
    """
    config_cls, extra = ARCHS[arch]
    config = config_cls(**{**TINY, **extra, **overrides})
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    with torch.no_grad():  # random (non-unit) norm weights and biases too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> "numpy.ndarray":  # noqa: F821
    """f32[len(token_ids), V] logits of a full forward (the oracle)."""
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=False)
    return out.logits[0].float().numpy()


def copy_tokenizer(source: pathlib.Path, directory: pathlib.Path) -> pathlib.Path:
    """Copies ``TOKENIZER_FILES`` that ``source`` has into ``directory``; returns ``directory``.

    The demo tokenizer's vocabulary is larger than a tiny model's V: tests
    send token ids below V and only detokenize what the model generates.
    """
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    return directory
