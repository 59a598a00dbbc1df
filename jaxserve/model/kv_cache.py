"""The physical paged KV cache: per-layer arrays, written through a slot mapping.

Layout (docs/kv_cache.md): for each layer, ``k`` and ``v`` are ``[B, K, S, H]``
(blocks, KV heads, block slots, head dim). Slot ``s`` is block ``s // S``,
offset ``s % S``. Block 0 is the *null block*: padding tokens write there and
block tables are padded with it, so the engine never hands it to a request
(``NULL_BLOCK``).

The cache is donated into the jitted step, so writes are in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig

NULL_BLOCK = 0  # reserved: scratch target of padding tokens, never allocated


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer K and V arrays, each ``[B, K, S, H]`` in the cache dtype."""

    k: tuple[jax.Array, ...]  # L × [B, K, S, H]
    v: tuple[jax.Array, ...]  # L × [B, K, S, H]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]

    def replace_layer(self, layer: int, k: jax.Array, v: jax.Array) -> "KVCache":
        """Returns a cache with layer ``layer`` replaced (trace-time helper)."""
        ks, vs = list(self.k), list(self.v)
        ks[layer], vs[layer] = k, v
        return KVCache(k=tuple(ks), v=tuple(vs))


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: jnp.dtype) -> int:
    """Bytes one block takes across all layers, K and V (2·L·K·S·H·itemsize)."""
    return (2 * config.num_layers * config.num_kv_heads * block_size * config.head_dim
            * jnp.dtype(dtype).itemsize)


def init_kv_cache(config: ModelConfig, num_blocks: int, block_size: int,
                  dtype: jnp.dtype = jnp.float32) -> KVCache:
    """Allocates a zeroed cache of ``num_blocks`` blocks (block 0 is the null block).

    Raises:
      ValueError: num_blocks < 2 or block_size < 1.
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    shape = (num_blocks, config.num_kv_heads, block_size, config.head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    return KVCache(k=tuple(zeros() for _ in range(config.num_layers)),
                   v=tuple(zeros() for _ in range(config.num_layers)))


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
