"""Flax NNX definitions of the Llama family: Llama, Mistral, Qwen2, Qwen3.

One module tree covers the four architectures; they differ only in flags of
``ModelConfig``: ``attention_bias`` (Qwen2's q/k/v bias), ``qk_norm`` (Qwen3's
per-head RMSNorm on q and k), ``sliding_window`` (Mistral) and
``tie_word_embeddings``. Source of the maths: transformers'
``modeling_llama.py`` / ``modeling_qwen2.py`` / ``modeling_qwen3.py``.

Projections are fused at load time: ``qkv_proj`` is ``[D, (N + 2K)·H]`` and
``gate_up_proj`` is ``[D, 2F]`` — one matrix product each instead of three and
two, which matters at batch 1 on the CPU, where every product streams its
weights. Kernels are stored ``[in, out]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model import rope
from jaxserve.model.attention import AttentionMetadata, paged_attention
from jaxserve.model.kv_cache import KVCache, write_kv

_INIT_STD = 0.02  # only for abstract construction and standalone random models


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(_INIT_STD * jax.random.normal(rngs.params(), shape, dtype))


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich, 2019), computed in float32 as transformers does."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))  # [dim]
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        n, k, h, d = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
        self.config = config
        self.qkv_proj = _param(rngs, (d, (n + 2 * k) * h), dtype)  # [D, (N + 2K)·H]
        self.qkv_bias = nnx.Param(jnp.zeros(((n + 2 * k) * h,), dtype)) if config.attention_bias else None
        self.o_proj = _param(rngs, (n * h, d), dtype)  # [N·H, D]
        if config.qk_norm:
            self.q_norm = RMSNorm(h, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(h, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array,
                 v_cache: jax.Array, metadata: AttentionMetadata, backend: str
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [T, D]; cos, sin: f32[T, H/2]; caches [B, K, S, H] → ([T, D], k_cache, v_cache)."""
        cfg = self.config
        n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        t = x.shape[0]
        qkv = x @ self.qkv_proj[...]  # [T, (N + 2K)·H]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias[...]
        q = qkv[:, : n * h].reshape(t, n, h)  # [T, N, H]
        key = qkv[:, n * h: (n + k) * h].reshape(t, k, h)  # [T, K, H]
        value = qkv[:, (n + k) * h:].reshape(t, k, h)  # [T, K, H]
        if self.q_norm is not None:
            q, key = self.q_norm(q), self.k_norm(key)
        q = rope.apply_rope(q, cos, sin)
        key = rope.apply_rope(key, cos, sin)
        with jax.named_scope("kv_write"):  # scope names: benchmarks/step_profile.py
            k_cache, v_cache = write_kv(k_cache, v_cache, key, value, metadata.slot_mapping)
        with jax.named_scope("attention"):
            out = paged_attention(q, k_cache, v_cache, metadata, sm_scale=h ** -0.5,
                                  backend=backend, sliding_window=cfg.sliding_window)
        return out.reshape(t, n * h) @ self.o_proj[...], k_cache, v_cache


class MLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer, 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_up_proj = _param(rngs, (d, 2 * f), dtype)  # [D, 2F]
        self.down_proj = _param(rngs, (f, d), dtype)  # [F, D]

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(x @ self.gate_up_proj[...], 2, axis=-1)
        return (jax.nn.silu(gate) * up) @ self.down_proj[...]


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = Attention(config, dtype, rngs)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, rngs)

    def __call__(self, x, cos, sin, k_cache, v_cache, metadata, backend):
        attn_out, k_cache, v_cache = self.attn(
            self.input_norm(x), cos, sin, k_cache, v_cache, metadata, backend)
        x = x + attn_out
        x = x + self.mlp(self.post_attn_norm(x))
        return x, k_cache, v_cache


class CausalLM(nnx.Module):
    """A Llama-family decoder with its LM head.

    ``__call__`` runs the body over the step's T tokens and returns the final
    hidden states; ``logits`` projects selected rows to the vocabulary.
    """

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.config = config
        self.embed = _param(rngs, (config.vocab_size, config.hidden_size), dtype)  # [V, D]
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (None if config.tie_word_embeddings
                        else _param(rngs, (config.hidden_size, config.vocab_size), dtype))  # [D, V]

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
                 metadata: AttentionMetadata, backend: str) -> tuple[jax.Array, KVCache]:
        """input_ids, positions: i32[T] → (hidden [T, D] after the final norm, kv_cache)."""
        x = jnp.take(self.embed[...], input_ids, axis=0)  # [T, D]
        cos, sin = rope.rope_cos_sin(positions, rope.inverse_frequencies(self.config))
        ks, vs = list(kv_cache.k), list(kv_cache.v)
        for i, layer in enumerate(self.layers):
            x, ks[i], vs[i] = layer(x, cos, sin, ks[i], vs[i], metadata, backend)
        return self.norm(x), KVCache(k=tuple(ks), v=tuple(vs))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [R, D] → f32[R, V]."""
        if self.lm_head is None:
            out = jnp.einsum("rd,vd->rv", hidden, self.embed[...])
        else:
            out = hidden @ self.lm_head[...]
        return out.astype(jnp.float32)
