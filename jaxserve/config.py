"""Frozen configuration dataclasses shared by every process.

Dependency-free (no jax): the api and engine processes import this module.
Values derived at start-up come back as new objects (``dataclasses.replace``),
never by assignment.

Shape legend used across the project (docs/legend.md): T tokens in the step,
R requests, D model dim, N query heads, K KV heads, H head dim, B blocks,
S block size, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

# Architectures the model package implements (transformers' class names).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Weight quantization methods (vLLM's ``quantization`` setting; jaxserve.model.quantization).
QUANTIZATION_METHODS = ("int8", "int4", "fp8")
# int4's group: consecutive input elements sharing one scale (jaxserve.model.quantization).
INT4_GROUP_SIZE = 32


def check_quantization(quantization: str | None, field: str = "quantization",
                       tensor_parallel_size: int = 1) -> None:
    """Raises ValueError (one line, naming ``field``) for an unsupported quantization
    method (the supported values listed), or int4 with ``tensor_parallel_size`` > 1 (its
    group scales are not split over devices); None (unquantized) and
    ``QUANTIZATION_METHODS`` pass."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"{field} must be one of None, "
                         f"{', '.join(map(repr, QUANTIZATION_METHODS))}; got {quantization!r}")
    if quantization == "int4" and tensor_parallel_size > 1:
        raise ValueError(f"{field}='int4' runs on one device; got tensor_parallel_size="
                         f"{tensor_parallel_size} (use int8 for tensor parallelism)")


# KV cache dtypes (vLLM's ``kv_cache_dtype``): "auto" stores keys and values in the
# parameter dtype; "fp8" and its alias "fp8_e4m3" in e4m3 with a scale per layer
# (jaxserve.model.kv_cache). vLLM's fp8_e5m2 and fp8_inc are not served.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def check_kv_cache_dtype(kv_cache_dtype: str, field: str = "kv_cache_dtype") -> None:
    """Raises ValueError (one line, naming ``field`` and the supported values) unless
    ``kv_cache_dtype`` is one of ``KV_CACHE_DTYPES``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}; "
                         f"got {kv_cache_dtype!r}")


def kv_cache_dtype_name(kv_cache_dtype: str, dtype: str) -> str:
    """The cache arrays' dtype name: ``dtype`` (the parameters') for "auto", else
    "float8_e4m3fn". Raises ValueError as ``check_kv_cache_dtype``."""
    check_kv_cache_dtype(kv_cache_dtype)
    return dtype if kv_cache_dtype == "auto" else "float8_e4m3fn"


def check_kv_cache_fits(num_kv_blocks: int, block_size: int, max_model_len: int) -> None:
    """Raises ValueError (one line, naming the flags to change) unless one sequence of
    ``max_model_len`` tokens fits the cache's ``num_kv_blocks`` blocks of ``block_size``
    tokens less the reserved null block: a longer sequence could never finish, even alone.
    The worker checks it once the cache is sized, before compiling the model bodies; the
    engine again on the worker's reported geometry."""
    usable = (num_kv_blocks - 1) * block_size
    if usable < max_model_len:
        raise ValueError(
            f"the KV cache holds {usable} tokens ({num_kv_blocks - 1} usable block(s) of "
            f"{block_size}), fewer than max_model_len={max_model_len}: raise --num-kv-blocks "
            f"/ --kv-cache-bytes or lower --max-model-len (LLM: num_kv_blocks / "
            f"kv_cache_bytes, max_model_len)")


@dataclasses.dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling.

    Source: Meta's Llama 3.1 reference code (``apply_scaling``), mirrored by
    transformers' ``_compute_llama3_parameters``.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, read from a Hugging Face config.

    Attributes are in the field's units: sizes in elements, lengths in tokens.
    """

    architecture: str
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on the q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None  # Mistral; None = full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise NotImplementedError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head (N / K), the GQA group size."""
        return self.num_heads // self.num_kv_heads

    def for_tensor_parallel(self, tensor_parallel_size: int) -> "ModelConfig":
        """The architecture as a tensor-parallel group of TP devices builds it.

        Each device holds N / TP query heads and F / TP MLP columns. With K >=
        TP it holds K / TP KV heads and this config is returned as it is;
        with TP > K (a multiple of K) each KV head is replicated on TP / K
        devices, so the returned copy has ``num_kv_heads = TP`` (the same
        grouped-query attention; docs/scale_out.md).

        Raises:
          ValueError: TP does not divide N or F, or TP and K divide neither
            way (the message names the numbers).
        """
        tp = tensor_parallel_size
        n, k, f = self.num_heads, self.num_kv_heads, self.intermediate_size
        what = f"tensor_parallel_size={tp} does not fit {self.architecture}"
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if n % tp:
            raise ValueError(f"{what}: its {n} query heads do not split evenly over {tp} "
                             f"devices (choose a divisor of {n})")
        if f % tp:
            raise ValueError(f"{what}: its MLP width {f} does not split evenly over {tp} "
                             f"devices")
        if k % tp == 0:
            return self
        if tp % k:
            raise ValueError(f"{what}: its {k} KV heads neither split evenly over {tp} devices "
                             f"nor replicate evenly onto them (choose a divisor or a multiple "
                             f"of {k})")
        return dataclasses.replace(self, num_kv_heads=tp)

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """Builds a ModelConfig from a transformers ``PretrainedConfig``.

        Raises:
          NotImplementedError: the architecture is not one of
            ``SUPPORTED_ARCHITECTURES``, or its RoPE scaling type is unknown.
        """
        archs = list(getattr(hf_config, "architectures", None) or [])
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(
            getattr(hf_config, "model_type", ""), "?")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope_scaling, rope_theta = _rope_from_hf(hf_config)
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        sliding = getattr(hf_config, "sliding_window", None)
        if arch.startswith("Qwen") and not getattr(hf_config, "use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf_config, "attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_scaling=rope_scaling,
            sliding_window=sliding,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        """Reads ``config.json`` of a Hugging Face model directory through AutoConfig."""
        from transformers import AutoConfig  # heavy import, kept local

        return cls.from_hf(AutoConfig.from_pretrained(os.fspath(model_dir)))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _rope_from_hf(hf_config: Any) -> tuple[RopeScaling | None, float]:
    """Returns (llama3 scaling or None, theta), for transformers 4.5x and 5.x.

    transformers 5 moves ``rope_theta`` and ``rope_scaling`` into
    ``rope_parameters``; 4.5x keeps them at the top level.
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or params or {}
    theta = getattr(hf_config, "rope_theta", None) or params.get("rope_theta") or 10000.0
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return None, float(theta)
    if rope_type == "llama3":
        return RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        ), float(theta)
    raise NotImplementedError(f"rope type {rope_type!r} is not supported; supported: default, llama3")
