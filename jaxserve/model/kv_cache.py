"""The physical paged KV cache: per-layer arrays, written through a slot mapping.

Layout (docs/kv_cache.md): for each layer, ``k`` and ``v`` are ``[B, K, S, H]``
(blocks, KV heads, block slots, head dim); a model built with
``scan_layers`` keeps them stacked, one ``[L, B, K, S, H]`` array each.
Slot ``s`` is block ``s // S``, offset ``s % S``. Block 0 is the *null block*: padding tokens write there and
block tables are padded with it, so the engine never hands it to a request
(``NULL_BLOCK``).

The cache is donated into the jitted step, so writes are in place.

An fp8 cache (``float8_e4m3fn``, vLLM's ``kv_cache_dtype="fp8"``) stores each
key and value divided by its layer's scale (``KVCache.k_scale`` / ``v_scale``,
f32[L]; 1.0 unless the checkpoint gives calibrated scales, as in vLLM), clipped
to e4m3's range (±448); attention multiplies them back (``attention.paged_attention``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import cpu_kernels
from jaxserve.config import ModelConfig
from jaxserve.model.sharding import kv_cache_partition_spec

NULL_BLOCK = 0  # reserved: scratch target of padding tokens, never allocated
# The fp8 cache's element type: e4m3 (OCP FP8, "fn": finite, no infinities), the
# format of vLLM's ``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"``.
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448.0, e4m3fn's largest finite value


def is_fp8(dtype) -> bool:
    """Whether a cache of ``dtype`` is an fp8 cache (stores scaled e4m3 values)."""
    return jnp.dtype(dtype) == jnp.dtype(FP8_DTYPE)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer K and V arrays, each ``[B, K, S, H]`` in the cache dtype.

    Stacked (``scan_layers``): one ``[L, B, K, S, H]`` array each. An fp8 cache
    also carries its per-layer scales (f32[L], replicated on a mesh); other
    caches have None.
    """

    k: tuple[jax.Array, ...]  # L × [B, K, S, H], or 1 × [L, B, K, S, H]
    v: tuple[jax.Array, ...]  # likewise
    k_scale: jax.Array | None = None  # f32[L]: a stored key is key / k_scale[layer]
    v_scale: jax.Array | None = None  # f32[L]: likewise for values

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[-4]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[-2]


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: jnp.dtype) -> int:
    """Bytes one block takes across all layers, K and V (2·L·K·S·H·itemsize)."""
    return (2 * config.num_layers * config.num_kv_heads * block_size * config.head_dim
            * jnp.dtype(dtype).itemsize)


def kv_cache_shapes(config: ModelConfig, num_blocks: int, block_size: int,
                    dtype: jnp.dtype = jnp.float32, stacked: bool = False,
                    mesh=None) -> KVCache:
    """The cache's ``jax.ShapeDtypeStruct``s (allocates nothing); see ``init_kv_cache``.

    With a ``mesh`` each spec carries its sharding (split over the KV heads).
    """
    shape = (num_blocks, config.num_kv_heads, block_size, config.head_dim)
    if stacked:
        shape = (config.num_layers,) + shape
    where = None if mesh is None else NamedSharding(mesh, kv_cache_partition_spec(len(shape)))
    spec = jax.ShapeDtypeStruct(shape, dtype, sharding=where)
    count = 1 if stacked else config.num_layers
    scale = None
    if is_fp8(dtype):
        scale = jax.ShapeDtypeStruct((config.num_layers,), jnp.float32,
                                     sharding=None if mesh is None else NamedSharding(mesh, P()))
    return KVCache(k=(spec,) * count, v=(spec,) * count, k_scale=scale, v_scale=scale)


def init_kv_cache(config: ModelConfig, num_blocks: int, block_size: int,
                  dtype: jnp.dtype = jnp.float32, stacked: bool = False,
                  mesh=None, scales: tuple[jax.Array, jax.Array] | None = None) -> KVCache:
    """Allocates a zeroed cache of ``num_blocks`` blocks (block 0 is the null block).

    ``stacked``: one ``[L, B, K, S, H]`` array for K and one for V, as a
    model built with ``scan_layers`` needs; otherwise L arrays ``[B, K, S, H]``.
    ``mesh``: a tensor-parallel mesh; each device then holds its K / TP KV
    heads of every array (``sharding.kv_cache_partition_spec``).
    ``scales``: an fp8 cache's (k_scale, v_scale), f32[L] each; None: 1.0 for
    every layer (vLLM's default without calibrated scales).

    Raises:
      ValueError: num_blocks < 2, block_size < 1, or scales for a cache that is not
        fp8 or of a shape other than [L].
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    specs = kv_cache_shapes(config, num_blocks, block_size, dtype, stacked, mesh)
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), specs)
    if specs.k_scale is None:
        if scales is not None:
            raise ValueError(f"KV cache scales are for an fp8 cache; this one is "
                             f"{jnp.dtype(dtype).name}")
        return cache
    k_scale, v_scale = scales if scales is not None else (1.0, 1.0)
    place = lambda x: jax.device_put(  # noqa: E731
        jnp.broadcast_to(jnp.asarray(x, jnp.float32), specs.k_scale.shape), specs.k_scale.sharding)
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if jnp.ndim(value) not in (0, 1) or jnp.size(value) not in (1, config.num_layers):
            raise ValueError(f"KV cache {name} must be f32[{config.num_layers}], got shape "
                             f"{jnp.shape(value)}")
    return dataclasses.replace(cache, k_scale=place(k_scale), v_scale=place(v_scale))


def quantize_kv(x: jax.Array, dtype, scale: jax.Array | None) -> jax.Array:
    """Keys or values as a cache of ``dtype`` stores them.

    fp8 (``is_fp8``): ``clip(x / scale, -FP8_MAX, FP8_MAX)`` rounded to e4m3
    (clipped, not left to overflow: e4m3fn has no infinity and a value past 448
    would become NaN); other dtypes: ``x`` cast. ``scale``: the layer's f32
    scalar (fp8 only).
    """
    if not is_fp8(dtype):
        return x.astype(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(dtype)


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, k_scale: jax.Array | None = None,
             v_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Scatters the step's keys and values into one layer's cache.

    Args:
      k_cache, v_cache: [B, K, S, H].
      k, v: [T, K, H], the step's new keys and values.
      slot_mapping: i32[T], the cache slot of every token; padding tokens
        point into the null block (slots ``0 .. S - 1``).
      k_scale, v_scale: an fp8 cache's f32 scalars for this layer (``quantize_kv``).

    Returns:
      The updated (k_cache, v_cache).
    """
    block_size = k_cache.shape[2]
    block = slot_mapping // block_size
    offset = slot_mapping % block_size

    def plain(cache: jax.Array, values: jax.Array) -> jax.Array:
        return cache.at[block, :, offset].set(values, mode="drop")

    def in_place(cache: jax.Array, values: jax.Array) -> jax.Array:
        return cpu_kernels.write_kv_bytes(cache, values, slot_mapping)

    def scatter(cache: jax.Array, values: jax.Array) -> jax.Array:
        if not is_fp8(cache.dtype) or jax.default_backend() != "cpu" or not cpu_kernels.available():
            return plain(cache, values)
        # XLA's CPU backend has no fp8 update: it compiled this scatter into a float16 copy
        # of the whole cache and back (one layer's write into a 25 MB cache: 80 ms; float32
        # 0.02 ms). The C++ write updates the cache's bytes in place instead.
        return jax.lax.platform_dependent(cache, values, cpu=in_place, default=plain)

    return (scatter(k_cache, quantize_kv(k, k_cache.dtype, k_scale)),
            scatter(v_cache, quantize_kv(v, v_cache.dtype, v_scale)))
