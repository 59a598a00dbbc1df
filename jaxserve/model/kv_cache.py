"""The physical paged KV cache: per-layer arrays, written through a slot mapping.

Layout (docs/kv_cache.md): for each layer, ``k`` and ``v`` are ``[B, K, S, H]``
(blocks, KV heads, block slots, head dim); a model built with
``scan_layers`` keeps them stacked, one ``[L, B, K, S, H]`` array each.
Slot ``s`` is block ``s // S``, offset ``s % S``. Block 0 is the *null block*: padding tokens write there and
block tables are padded with it, so the engine never hands it to a request
(``NULL_BLOCK``).

The cache is donated into the jitted step, so writes are in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxserve.config import ModelConfig
from jaxserve.model.sharding import kv_cache_partition_spec

NULL_BLOCK = 0  # reserved: scratch target of padding tokens, never allocated


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer K and V arrays, each ``[B, K, S, H]`` in the cache dtype.

    Stacked (``scan_layers``): one ``[L, B, K, S, H]`` array each.
    """

    k: tuple[jax.Array, ...]  # L × [B, K, S, H], or 1 × [L, B, K, S, H]
    v: tuple[jax.Array, ...]  # likewise

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
    return KVCache(k=(spec,) * count, v=(spec,) * count)


def init_kv_cache(config: ModelConfig, num_blocks: int, block_size: int,
                  dtype: jnp.dtype = jnp.float32, stacked: bool = False,
                  mesh=None) -> KVCache:
    """Allocates a zeroed cache of ``num_blocks`` blocks (block 0 is the null block).

    ``stacked``: one ``[L, B, K, S, H]`` array for K and one for V, as a
    model built with ``scan_layers`` needs; otherwise L arrays ``[B, K, S, H]``.
    ``mesh``: a tensor-parallel mesh; each device then holds its K / TP KV
    heads of every array (``sharding.kv_cache_partition_spec``).

    Raises:
      ValueError: num_blocks < 2 or block_size < 1.
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    specs = kv_cache_shapes(config, num_blocks, block_size, dtype, stacked, mesh)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), specs)


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatters the step's keys and values into one layer's cache.

    Args:
      k_cache, v_cache: [B, K, S, H].
      k, v: [T, K, H], the step's new keys and values.
      slot_mapping: i32[T], the cache slot of every token; padding tokens
        point into the null block (slots ``0 .. S - 1``).

    Returns:
      The updated (k_cache, v_cache).
    """
    block_size = k_cache.shape[2]
    block = slot_mapping // block_size
    offset = slot_mapping % block_size
    k_cache = k_cache.at[block, :, offset].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[block, :, offset].set(v.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache
