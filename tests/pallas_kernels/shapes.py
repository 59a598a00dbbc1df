"""Abstract problem shapes shared by the lowering tests, the h100 tier and the benchmark.

Only shapes: nothing here allocates a cache, so Llama-3-8B-sized problems
(hundreds of rows, 8k contexts) cost nothing until compiled.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Problem:
    """One call's static shapes. MB = ceil(max_context / S); B = R * MB + 1 (null block)."""

    num_tokens: int  # T
    num_rows: int  # R
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    block_size: int  # S
    max_context: int  # tokens the block table addresses per row
    dtype: str
    kv_dtype: str | None = None  # the cache's dtype; None: ``dtype`` ("float8_e4m3fn": fp8)

    @property
    def max_blocks(self) -> int:
        return -(-self.max_context // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.num_rows * self.max_blocks + 1

    def specs(self, sharding=None) -> tuple[jax.ShapeDtypeStruct, ...]:
        """(q, k_cache, v_cache, block_table, seq_lens, query_start_loc) specs."""
        def spec(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        dt, kv = jnp.dtype(self.dtype), jnp.dtype(self.kv_dtype or self.dtype)
        cache = (self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        return (spec((self.num_tokens, self.num_heads, self.head_dim), dt), spec(cache, kv),
                spec(cache, kv), spec((self.num_rows, self.max_blocks), jnp.int32),
                spec((self.num_rows,), jnp.int32), spec((self.num_rows + 1,), jnp.int32))

    def kv_bytes_at_full_context(self) -> int:
        """K and V bytes a decode step must read when every row holds max_context tokens."""
        return (2 * self.num_rows * self.max_context * self.num_kv_heads * self.head_dim
                * jnp.dtype(self.kv_dtype or self.dtype).itemsize)


def table_problems(head_dim: int, block_size: int, dtype: str) -> dict[str, Problem]:
    """A decode-shaped (split-K) and a prefill-shaped call for one default-table entry."""
    common = dict(num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                  dtype=dtype)
    return {"decode": Problem(num_tokens=32, num_rows=32, max_context=1024, **common),
            "prefill": Problem(num_tokens=512, num_rows=16, max_context=2048, **common)}


# Llama-3-8B: 32 query heads over 8 KV heads, head_dim 128, bfloat16.
LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
LLAMA3_8B_DECODE_8K = Problem(num_tokens=256, num_rows=256, max_context=8192, **LLAMA3_8B)
LLAMA3_8B_BATCH1_8K = Problem(num_tokens=1, num_rows=1, max_context=8192, **LLAMA3_8B)
LLAMA3_8B_DECODE_2K = Problem(num_tokens=256, num_rows=256, max_context=2048, **LLAMA3_8B)
LLAMA3_8B_PREFILL_8K = Problem(num_tokens=2048, num_rows=256, max_context=8192, **LLAMA3_8B)
# The demo model (SmolLM2-135M): 9 query heads over 3 KV heads, head_dim 64.
DEMO_DECODE = Problem(num_tokens=16, num_rows=16, max_context=2048, num_heads=9, num_kv_heads=3,
                      head_dim=64, block_size=16, dtype="bfloat16")
