"""Rotary position embeddings (RoPE), default and Llama-3 scaled.

Layout: the "rotate half" convention of Hugging Face transformers — the two
halves of the head dim form the (real, imaginary) pairs. (GGUF files store
q/k rows permuted to the interleaved layout; the demo conversion undoes it.)
Source: Su et al., "RoFormer" (2021); Llama-3 scaling from Meta's Llama 3.1
reference ``apply_scaling``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """f32[H / 2] inverse frequencies ``theta ** (-2i / H)``, Llama-3 scaled if configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables for the given positions.

    Args:
      positions: i32[T].
      inv_freq: f32[H / 2].

    Returns:
      (cos, sin), each f32[T, H / 2].
    """
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x`` [T, heads, H] by the angles whose cos/sin are f32[T, H / 2]."""
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)
