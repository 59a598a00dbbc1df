"""Weight-only int8 quantization (vLLM's ``quantization`` setting, value "int8").

Symmetric, per output channel: a kernel stored ``[out, in]`` (as
``jaxserve.model.llama.linear`` stores them) becomes ``q i8[out, in]`` and
``scale f32[out]`` with

    scale[o] = max_i |w[o, i]| / 127,   q[o, i] = round(w[o, i] / scale[o])

(round half to even, clipped to [-127, 127]; a row of zeros gets scale 1 and
q = 0), so ``w ≈ q · scale[:, None]`` with an error of at most ``scale[o] / 2``
per element. This is the absmax ("symmetric linear") scheme of LLM.int8()'s
vector-wise quantization (Dettmers et al., 2022, section 3.1) without its
outlier decomposition, and what vLLM's and TensorRT-LLM's weight-only int8
("W8A16") store: int8 values with one float scale per output channel, the
activations kept in floating point.

Quantized at load time from the float checkpoint (``jaxserve.model.loader``):
every linear kernel of the decoder (the fused ``qkv_proj`` and
``gate_up_proj``, ``o_proj``, ``down_proj``), the LM head and the embedding
table. The embedding ``[V, D]`` is quantized per row (its "output channel" as
the tied LM head), and a lookup dequantizes the gathered rows
(``embed_lookup``). In the parameter pytree a quantized kernel ``name`` keeps
its name (now int8) and gains a sibling ``name + SCALE_SUFFIX`` (f32[out],
or ``[L, out]`` for scanned layers); norms and biases stay float.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The values of EngineConfig.quantization / LLM(quantization=...) / --quantization, and
# their check (jax-free, in jaxserve.config, for the engine and api processes).
from jaxserve.config import QUANTIZATION_METHODS as METHODS, check_quantization as check_method
# A quantized kernel ``name``'s scale parameter is ``name + SCALE_SUFFIX``.
SCALE_SUFFIX = "_scale"
# The parameters quantized (their names in the parameter pytree).
QUANTIZED_PARAMS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed", "lm_head")
_QMAX = 127


def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [..., out, in] (any float dtype) → (q i8[..., out, in], scale f32[..., out]).

    Leading axes (a scanned model's ``[L]``) are kept: each output row of each
    matrix gets its own scale, ``max|w[..., o, :]| / 127`` (1 for a zero row).
    Computed in float32.
    """
    wf = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(wf), axis=-1)  # [..., out]
    scale = jnp.where(absmax > 0, absmax / _QMAX, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(wf / scale[..., None]), -_QMAX, _QMAX).astype(jnp.int8)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """q i8[..., out, in], scale f32[..., out] → [..., out, in] of ``dtype``: q · scale."""
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def embed_lookup(q: jax.Array, scale: jax.Array, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows ``ids`` (i32[T]) of a quantized embedding (q i8[V, D], scale f32[V]) → [T, D] of
    ``dtype``: the gathered int8 rows times their scales (the table is never dequantized)."""
    rows = jnp.take(q, ids, axis=0).astype(jnp.float32)  # [T, D]
    return (rows * jnp.take(scale, ids, axis=0)[:, None]).astype(dtype)


def quantize_params(params: dict, quantization: str | None) -> dict:
    """A float model's pure-dict parameters → the quantized model's (a new dict).

    Every ``QUANTIZED_PARAMS`` array is replaced by its int8 values and a
    ``+ SCALE_SUFFIX`` sibling is added; everything else is kept. For random
    models and tests; the loader quantizes tensor by tensor as it reads them.
    ``quantization`` None returns ``params`` unchanged.

    Raises:
      ValueError: an unsupported method (``check_method``).
    """
    check_method(quantization)
    if quantization is None:
        return params
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = quantize_params(value, quantization)
        elif key in QUANTIZED_PARAMS and value is not None:
            out[key], out[key + SCALE_SUFFIX] = quantize(value)
        else:
            out[key] = value
    return out
