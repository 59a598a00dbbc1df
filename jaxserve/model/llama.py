"""Flax NNX definitions of the Llama family: Llama, Mistral, Qwen2, Qwen3.

One module tree covers the four architectures; they differ only in flags of
``ModelConfig``: ``attention_bias`` (Qwen2's q/k/v bias), ``qk_norm`` (Qwen3's
per-head RMSNorm on q and k), ``sliding_window`` (Mistral) and
``tie_word_embeddings``. Source of the maths: transformers'
``modeling_llama.py`` / ``modeling_qwen2.py`` / ``modeling_qwen3.py``.

With ``scan_layers`` the decoder layers are one ``DecoderLayer`` whose
parameters are stacked on a leading ``[L]`` axis, run by ``jax.lax.scan``
over a stacked KV cache (``KVCache`` with one ``[L, B, K, S, H]`` array for
K and one for V). Scanning compiles one layer instead of L — a demo-model
body executable in 1.15 s instead of 5.1 s here — but on the CPU it decodes
~1.3× slower (XLA copies each layer's weights out of the stack every
step): a switch, off by default, chosen per backend by measurement
(docs/model.md). Off on a GPU too: in the deviceless H100 compile of a
Llama-3-8B-shaped body XLA copies each layer's weights out of the stack
before its GEMMs as well (docs/worker.md, *GPU start-up, deviceless*).

Projections are fused at load time: ``qkv_proj`` is ``[(N + 2K)·H, D]`` and
``gate_up_proj`` is ``[2F, D]`` — one matrix product each instead of three and
two, which matters at batch 1 on the CPU, where every product streams its
weights. Kernels are stored ``[out, in]``, as PyTorch's ``nn.Linear`` and the
checkpoints store them (``linear``): on the CPU, XLA's products of 16 to 64
rows ran 11–21 % faster against ``[out, in]`` kernels than against
``[in, out]`` ones in a 30-layer chain of the demo model's shapes, and equal
within noise at 1 to 8 rows (docs/model.md). Float32 products of up to 128 rows
on the CPU (32 without AVX-512) run the C++ kernel ``cpu_kernels.matmul``, which reads
that layout too.

Built with ``quantization="int8"`` (weight-only int8, ``jaxserve.model.quantization``),
every kernel above, the embedding and the LM head are int8 ``[out, in]`` with a
float32 scale per output channel beside them (``<name>_scale``); ``linear`` then
runs the C++ int8 product on the CPU (``cpu_kernels.matmul_i8``, any row count)
and ``(x @ q) * scale`` in jnp elsewhere, and the embedding lookup dequantizes
only the gathered rows. ``quantization="fp8"`` makes the decoder's kernels float8 e4m3
with a float32 scale per output channel and quantizes each linear's input per token
(W8A8, XLA's fp8 dot); the embedding and LM head stay float. ``quantization="int4"`` makes the decoder's kernels packed
int4 ``u8[out, in / 2]`` with a (step, offset) per group of 32 inputs
``f32[out, in / 32, 2]`` (``cpu_kernels.matmul_i4`` on the CPU; elsewhere the jnp
form, which dequantizes the kernel and multiplies) and keeps the embedding and LM
head int8.

Built with a ``mesh`` (tensor parallel over TP devices, ``jaxserve.model.sharding``),
the fused output features are grouped by device and the model splits them per group;
the KV write and attention run per device under ``jax.shard_map`` (each device
its own KV heads), and the logits are gathered to full rows. Without a mesh
(TP = 1) the same code runs with one group.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import cpu_kernels

from jaxserve.config import ModelConfig
from jaxserve.model import quantization as quant, rope
from jaxserve.model.attention import AttentionMetadata, paged_attention, with_schedule
from jaxserve.model.kv_cache import KVCache, write_kv
from jaxserve.model.sharding import TP_AXIS, kv_cache_partition_spec, mesh_size

_INIT_STD = 0.02  # only for abstract construction and standalone random models


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(_INIT_STD * jax.random.normal(rngs.params(), shape, dtype))


def _weight(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype,
            quantization: str | None) -> tuple[nnx.Param, nnx.Param | None]:
    """A random kernel [out, in]: (float kernel, None) unquantized, else the quantized kernel
    and its scale (``quant.quantize`` with ``quantization``)."""
    if quantization is None:
        return _param(rngs, shape, dtype), None
    q, scale = quant.quantize(_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32),
                              quantization)
    return nnx.Param(q), nnx.Param(scale)


def _xla_linear(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((), ())))


# The quantized products by method (jaxserve.model.quantization.method_of): the C++
# kernel for the CPU, its jnp form for every other case.
_QUANTIZED_PRODUCTS = {"int8": (cpu_kernels.matmul_i8, cpu_kernels.matmul_i8_reference),
                       "int4": (cpu_kernels.matmul_i4, cpu_kernels.matmul_i4_reference)}


def _quantized_linear(x: jax.Array, q: jax.Array, scale: jax.Array,
                      tensor_parallel: bool) -> jax.Array:
    if quant.method_of(q) == "fp8":  # XLA's fp8 dot on every platform (no CPU kernel)
        return quant.matmul_fp8(x, q, scale)
    kernel, reference = _QUANTIZED_PRODUCTS[quant.method_of(q)]
    if (tensor_parallel or x.dtype != jnp.float32 or jax.default_backend() != "cpu"
            or not cpu_kernels.available()
            or math.prod(x.shape[:-1]) > cpu_kernels.matmul_max_rows(quantized=True)):
        return reference(x, q, scale)
    return jax.lax.platform_dependent(x, q, scale, cpu=kernel, default=reference)


def linear(x: jax.Array, kernel: jax.Array, scale: jax.Array | None = None, *,
           tensor_parallel: bool = False) -> jax.Array:
    """x [..., in] times a kernel stored [out, in] (``x @ kernel.T``) → [..., out].

    With ``scale`` the kernel is quantized (``jaxserve.model.quantization``, the method
    read from the kernel's dtype): int8 ``[out, in]`` with scale f32[out], the product
    ``(x @ kernel.T) * scale``, or packed int4 u8[out, in / 2] with (step, offset)
    f32[out, in / G, 2], the product with the dequantized kernel. On the CPU, for float32
    x at any row count, the C++ kernel (``cpu_kernels.matmul_i8`` / ``matmul_i4``,
    the integers widened in registers; without AVX-512 only up to
    ``cpu_kernels.matmul_max_rows(quantized=True)`` rows, 64); otherwise (a GPU lowering,
    a tensor-parallel split, another dtype, more rows) its jnp form (``matmul_i8_reference`` /
    ``matmul_i4_reference``).
    An fp8 kernel f8e4m3[out, in] with scale f32[out] quantizes x per token and runs
    XLA's fp8 dot everywhere (``quantization.matmul_fp8``).

    On the CPU, a float32 product of at most ``cpu_kernels.matmul_max_rows()``
    rows (128 with AVX-512, 32 without) runs the C++ kernel (``cpu_kernels.matmul``)
    where it builds: it reads
    the kernel in place, where XLA's CPU product of 2 to 32 rows runs far below
    memory speed and repacks the kernel for every product of more. Everything
    else, a kernel split over a tensor-parallel mesh included, is XLA's product.
    The platform is chosen at lowering (``jax.lax.platform_dependent``), so
    lowering for a GPU keeps XLA's product.
    """
    if scale is not None:
        return _quantized_linear(x, kernel, scale, tensor_parallel)
    rows = math.prod(x.shape[:-1])
    if (tensor_parallel or rows > cpu_kernels.matmul_max_rows() or x.dtype != jnp.float32
            or kernel.dtype != jnp.float32 or jax.default_backend() != "cpu"
            or not cpu_kernels.available()):
        return _xla_linear(x, kernel)
    return jax.lax.platform_dependent(x, kernel, cpu=cpu_kernels.matmul, default=_xla_linear)


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich, 2019), computed in float32 as transformers does."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))  # [dim]
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


def _layer_scales(kv_cache: KVCache, layer) -> tuple:
    """Layer ``layer``'s (k_scale, v_scale) f32 scalars of an fp8 cache, else (None, None)."""
    if kv_cache.k_scale is None:
        return None, None
    return kv_cache.k_scale[layer], kv_cache.v_scale[layer]


def _write_and_attend(q, key, value, k_cache, v_cache, scales, metadata, *, sm_scale,
                      backend, sliding_window):
    """The step's K/V written into one layer's cache, then attention over it.

    q: [T, N, H]; key, value: [T, K, H]; caches [B, K, S, H] → ([T, N, H], caches).
    ``scales``: an fp8 cache's (k_scale, v_scale) f32 scalars for the layer, else
    (None, None). Under ``shard_map`` N and K are one device's heads.
    """
    k_scale, v_scale = scales
    with jax.named_scope("kv_write"):  # scope names: benchmarks/step_profile.py
        k_cache, v_cache = write_kv(k_cache, v_cache, key, value, metadata.slot_mapping,
                                    k_scale, v_scale)
    with jax.named_scope("attention"):
        out = paged_attention(q, k_cache, v_cache, metadata, sm_scale=sm_scale,
                              backend=backend, sliding_window=sliding_window,
                              k_scale=k_scale, v_scale=v_scale)
    return out, k_cache, v_cache


class Attention(nnx.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs,
                 mesh: Mesh | None = None, quantization: str | None = None):
        n, k, h, d = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
        self.config = config
        self.mesh = mesh
        # [(N + 2K)·H, D]: rows [q | k | v] per device group (jaxserve.model.sharding);
        # quantized with its scale when quantized (None otherwise), as every kernel
        self.qkv_proj, self.qkv_proj_scale = _weight(rngs, ((n + 2 * k) * h, d), dtype,
                                                     quantization)
        self.qkv_bias = nnx.Param(jnp.zeros(((n + 2 * k) * h,), dtype)) if config.attention_bias else None
        self.o_proj, self.o_proj_scale = _weight(rngs, (d, n * h), dtype, quantization)  # [D, N·H]
        if config.qk_norm:
            self.q_norm = RMSNorm(h, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(h, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array,
                 v_cache: jax.Array, metadata: AttentionMetadata, backend: str,
                 scales: tuple = (None, None)) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [T, D]; cos, sin: f32[T, H/2]; caches [B, K, S, H] → ([T, D], k_cache, v_cache).

        ``scales``: an fp8 cache's (k_scale, v_scale) f32 scalars for this layer."""
        cfg = self.config
        n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        g = mesh_size(self.mesh)  # device groups of the fused output features
        t = x.shape[0]
        qkv = linear(x, self.qkv_proj[...], _value(self.qkv_proj_scale),
                     tensor_parallel=g > 1)  # [T, (N + 2K)·H]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias[...]
        qkv = qkv.reshape(t, g, -1)  # [T, TP, (N + 2K)·H / TP]
        nq, nk = n // g * h, k // g * h  # one group's q and k (or v) features
        q = qkv[:, :, :nq].reshape(t, n, h)  # [T, N, H]
        key = qkv[:, :, nq: nq + nk].reshape(t, k, h)  # [T, K, H]
        value = qkv[:, :, nq + nk:].reshape(t, k, h)  # [T, K, H]
        if self.q_norm is not None:
            q, key = self.q_norm(q), self.k_norm(key)
        q = rope.apply_rope(q, cos, sin)
        key = rope.apply_rope(key, cos, sin)
        attend = functools.partial(_write_and_attend, sm_scale=h ** -0.5, backend=backend,
                                   sliding_window=cfg.sliding_window)
        if self.mesh is not None:  # each device its own heads and its KV heads' cache
            heads, cache = P(None, TP_AXIS, None), kv_cache_partition_spec(k_cache.ndim)
            attend = jax.shard_map(attend, mesh=self.mesh,
                                   in_specs=(heads, heads, heads, cache, cache, P(), P()),
                                   out_specs=(heads, cache, cache), check_vma=False)
        out, k_cache, v_cache = attend(q, key, value, k_cache, v_cache, scales, metadata)
        return (linear(out.reshape(t, n * h), self.o_proj[...], _value(self.o_proj_scale),
                       tensor_parallel=g > 1),
                k_cache, v_cache)


class MLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer, 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs,
                 num_groups: int = 1, quantization: str | None = None):
        d, f = config.hidden_size, config.intermediate_size
        self.num_groups = num_groups
        # [2F, D]: rows [gate | up] per device group (jaxserve.model.sharding)
        self.gate_up_proj, self.gate_up_proj_scale = _weight(rngs, (2 * f, d), dtype,
                                                             quantization)
        self.down_proj, self.down_proj_scale = _weight(rngs, (d, f), dtype, quantization)  # [D, F]

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [T, D] → [T, D]."""
        t, g = x.shape[0], self.num_groups
        gate_up = linear(x, self.gate_up_proj[...], _value(self.gate_up_proj_scale),
                         tensor_parallel=g > 1)
        gate_up = gate_up.reshape(t, g, 2, -1)  # [T, TP, 2, F / TP]
        gate, up = gate_up[:, :, 0].reshape(t, -1), gate_up[:, :, 1].reshape(t, -1)  # [T, F]
        return linear(jax.nn.silu(gate) * up, self.down_proj[...], _value(self.down_proj_scale),
                      tensor_parallel=g > 1)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs,
                 mesh: Mesh | None = None, quantization: str | None = None):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = Attention(config, dtype, rngs, mesh, quantization)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, rngs, mesh_size(mesh), quantization)

    def __call__(self, x, cos, sin, k_cache, v_cache, metadata, backend, scales=(None, None)):
        attn_out, k_cache, v_cache = self.attn(
            self.input_norm(x), cos, sin, k_cache, v_cache, metadata, backend, scales)
        x = x + attn_out
        x = x + self.mlp(self.post_attn_norm(x))
        return x, k_cache, v_cache


def _value(param: nnx.Param | None) -> jax.Array | None:
    return None if param is None else param[...]


def _stacked_layers(config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs,
                    mesh: Mesh | None, quantization: str | None) -> DecoderLayer:
    """One DecoderLayer whose every parameter is the L layers' stacked on axis 0."""
    layers = [DecoderLayer(config, dtype, rngs, mesh, quantization)
              for _ in range(config.num_layers)]
    graphdef, first = nnx.split(layers[0])
    states = [first] + [nnx.state(layer) for layer in layers[1:]]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


class CausalLM(nnx.Module):
    """A Llama-family decoder with its LM head.

    ``__call__`` runs the body over the step's T tokens and returns the final
    hidden states; ``logits`` projects selected rows to the vocabulary.

    Args:
      config: the architecture.
      dtype: parameter dtype.
      rngs: initialisation keys (random models; the loader builds abstractly).
      scan_layers: stack the layers and run them with ``jax.lax.scan``; the
        KV cache must then be stacked too (``init_kv_cache(..., stacked=True)``).
      mesh: the tensor-parallel mesh (``sharding.make_mesh``), None for one
        device; ``config`` is then ``ModelConfig.for_tensor_parallel``'s.
      quantization: None, "int8", "int4" or "fp8" (``jaxserve.config.QUANTIZATION_METHODS``):
        every linear kernel, the embedding and the LM head int8 with a float32
        scale per output channel; or the decoder's kernels packed int4 with a float32
        step and offset per group of 32 inputs, the embedding and LM head int8; or the
        decoder's kernels float8 e4m3 with a float32 scale per output channel, the
        embedding and LM head of ``dtype``.

    Raises:
      ValueError: an unsupported ``quantization``.
    """

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs,
                 scan_layers: bool = False, mesh: Mesh | None = None,
                 quantization: str | None = None):
        quant.check_method(quantization)
        self.config = config
        self.scan_layers = scan_layers
        self.mesh = mesh
        v, d = config.vocab_size, config.hidden_size
        # [V, D], [V]; int8 under int4 too, float under fp8 (quant.method_for)
        head_method = None if quantization is None else quant.method_for("embed", quantization)
        self.embed, self.embed_scale = _weight(rngs, (v, d), dtype, head_method)
        if scan_layers:  # every parameter [L, ...]
            self.layers = _stacked_layers(config, dtype, rngs, mesh, quantization)
        else:
            self.layers = nnx.List([DecoderLayer(config, dtype, rngs, mesh, quantization)
                                    for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head, self.lm_head_scale = (
            (None, None) if config.tie_word_embeddings
            else _weight(rngs, (v, d), dtype, head_method))  # [V, D], [V]

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
                 metadata: AttentionMetadata, backend: str) -> tuple[jax.Array, KVCache]:
        """input_ids, positions: i32[T] → (hidden [T, D] after the final norm, kv_cache)."""
        if self.embed_scale is None:
            x = jnp.take(self.embed[...], input_ids, axis=0)  # [T, D]
        else:  # quantized: only the gathered rows are dequantized
            x = quant.embed_lookup(self.embed[...], self.embed_scale[...], input_ids,
                                   self.norm.weight[...].dtype)
        cos, sin = rope.rope_cos_sin(positions, rope.inverse_frequencies(self.config))
        metadata = with_schedule(metadata, num_tokens=input_ids.shape[0],
                                 num_heads=self.config.num_heads, k_cache=kv_cache.k[0],
                                 backend=backend, num_shards=mesh_size(self.mesh),
                                 dtype=x.dtype)
        # ^ once per step, for every layer
        if self.scan_layers:
            return self._scan_layers(x, cos, sin, kv_cache, metadata, backend)
        ks, vs = list(kv_cache.k), list(kv_cache.v)
        for i, layer in enumerate(self.layers):
            x, ks[i], vs[i] = layer(x, cos, sin, ks[i], vs[i], metadata, backend,
                                    _layer_scales(kv_cache, i))
        return self.norm(x), dataclasses.replace(kv_cache, k=tuple(ks), v=tuple(vs))

    def _scan_layers(self, x, cos, sin, kv_cache: KVCache, metadata: AttentionMetadata,
                     backend: str) -> tuple[jax.Array, KVCache]:
        """The layers by ``jax.lax.scan`` over the stacked parameters and cache.

        Layer ``i`` sees the stacked cache ``[L, B, K, S, H]`` as one
        ``[L·B, K, S, H]`` cache (a free reshape) through block ids shifted by
        ``i·B`` — block table and slot mapping alike — so attention and the KV
        write need no layer argument and the cache is updated in place.
        """
        (k_all,), (v_all,) = kv_cache.k, kv_cache.v
        num_layers, num_blocks, num_kv_heads, block_size, head_dim = k_all.shape
        flat = (num_layers * num_blocks, num_kv_heads, block_size, head_dim)
        graphdef, params = nnx.split(self.layers)

        def one_layer(carry, xs):
            h, k_cache, v_cache = carry
            layer_params, i = xs
            layer = nnx.merge(graphdef, layer_params)
            shifted = dataclasses.replace(
                metadata, slot_mapping=metadata.slot_mapping + i * (num_blocks * block_size),
                block_table=metadata.block_table + i * num_blocks)
            return layer(h, cos, sin, k_cache, v_cache, shifted, backend,
                         _layer_scales(kv_cache, i)), None

        (x, k_flat, v_flat), _ = jax.lax.scan(
            one_layer, (x, k_all.reshape(flat), v_all.reshape(flat)),
            (params, jnp.arange(num_layers, dtype=jnp.int32)))
        return self.norm(x), dataclasses.replace(kv_cache, k=(k_flat.reshape(k_all.shape),),
                                                 v=(v_flat.reshape(v_all.shape),))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [R, D] → f32[R, V] (whole rows on every device of a mesh)."""
        head, scale = ((self.embed, self.embed_scale) if self.lm_head is None
                       else (self.lm_head, self.lm_head_scale))  # [V, D] either way, [V]
        out = linear(hidden, head[...], _value(scale), tensor_parallel=mesh_size(self.mesh) > 1)
        out = out.astype(jnp.float32)
        if self.mesh is not None:  # the sampler sees full rows, as with one device
            out = jax.lax.with_sharding_constraint(out, NamedSharding(self.mesh, P()))
        return out
