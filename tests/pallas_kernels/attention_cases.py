"""Random ragged paged-attention problems and a float64 NumPy oracle.

Shared by the reference test and the kernel tests. A case poisons every
cache slot that no row owns with NaN, shuffles the physical blocks, pads the
block table with garbage (out-of-range) ids past each row's last block, and
mixes row kinds: empty rows, decode rows, rows of exactly one block, rows
ending on a block boundary, prefills continuing after cached blocks, padding
rows and padding tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Case:
    q: np.ndarray  # [T, N, H]
    k_cache: np.ndarray  # [B, K, S, H]
    v_cache: np.ndarray  # [B, K, S, H]
    block_table: np.ndarray  # i32[R, MB]
    seq_lens: np.ndarray  # i32[R]
    query_start_loc: np.ndarray  # i32[R + 1]


# (query tokens, context tokens already cached) per row; S-relative helpers below.
def default_rows(block_size: int) -> list[tuple[int, int]]:
    s = block_size
    return [
        (1, 37),          # decode row with a long context
        (0, 0),           # empty row (padding)
        (s, 0),           # fresh prefill of exactly one block
        (7, 3 * s),       # prefill continuing after 3 cached blocks
        (1, 2 * s - 1),   # decode row ending on a block boundary
        (2 * s + 5, 0),   # fresh prefill over several blocks
        (1, 0),           # decode of a one-token sequence
        (3, s + 2),       # short chunk after a partial block
    ]


def make_case(rng: np.random.Generator, *, num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, rows: list[tuple[int, int]] | None = None,
              pad_tokens: int = 3, pad_rows: int = 2, spare_blocks: int = 5) -> Case:
    rows = default_rows(block_size) if rows is None else rows
    lens = [q + c for q, c in rows]
    blocks_needed = [-(-n // block_size) for n in lens]
    max_blocks = max(blocks_needed) + 1
    num_blocks = sum(blocks_needed) + spare_blocks + 1
    perm = rng.permutation(np.arange(1, num_blocks))
    k_cache = np.full((num_blocks, num_kv_heads, block_size, head_dim), np.nan, np.float32)
    v_cache = np.full_like(k_cache, np.nan)
    table = rng.integers(num_blocks, 10 * num_blocks, (len(rows) + pad_rows, max_blocks))
    used = 0
    for r, n in enumerate(lens):
        ids = perm[used:used + blocks_needed[r]]
        used += blocks_needed[r]
        table[r, :len(ids)] = ids
        for p in range(n):  # fill exactly the owned slots
            b, o = ids[p // block_size], p % block_size
            k_cache[b, :, o] = rng.standard_normal((num_kv_heads, head_dim))
            v_cache[b, :, o] = rng.standard_normal((num_kv_heads, head_dim))
    q_lens = [q for q, _ in rows] + [0] * pad_rows
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total = int(qsl[-1]) + pad_tokens
    q = rng.standard_normal((total, num_heads, head_dim)).astype(np.float32)
    return Case(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table.astype(np.int32),
                seq_lens=np.array(lens + [0] * pad_rows, np.int32), query_start_loc=qsl)


def oracle(case: Case, *, sm_scale: float, sliding_window: int | None = None,
           soft_cap: float | None = None) -> np.ndarray:
    """float64 loop-by-loop attention; padding tokens give zeros. Returns [T, N, H]."""
    q = case.q.astype(np.float64)
    out = np.zeros_like(q)
    num_heads, num_kv_heads = q.shape[1], case.k_cache.shape[1]
    block_size = case.k_cache.shape[2]
    group = num_heads // num_kv_heads
    for r in range(len(case.seq_lens)):
        start, end = case.query_start_loc[r], case.query_start_loc[r + 1]
        ctx = case.seq_lens[r] - (end - start)
        n = case.seq_lens[r]
        ids = case.block_table[r, : -(-n // block_size)] if n else []
        keys = np.concatenate([case.k_cache[b] for b in ids], axis=1)[:, :n] if n else None
        vals = np.concatenate([case.v_cache[b] for b in ids], axis=1)[:, :n] if n else None
        for i in range(start, end):
            p = ctx + (i - start)
            lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            for h in range(num_heads):
                kh = keys[h // group, lo:p + 1].astype(np.float64)
                vh = vals[h // group, lo:p + 1].astype(np.float64)
                s = kh @ q[i, h] * sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                w = np.exp(s - s.max())
                out[i, h] = (w / w.sum()) @ vh
    return out


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """‖out − ref‖ / ‖ref‖ (Frobenius)."""
    return float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))


def round_to(case: Case, dtype) -> Case:
    """The case with q and the caches rounded to ``dtype`` (kept as float32 NumPy), so that
    the float64 oracle sees exactly the inputs a low-precision kernel sees."""
    import jax.numpy as jnp  # noqa: PLC0415 (the module stays NumPy-only for its other users)

    rounded = {name: np.asarray(jnp.asarray(getattr(case, name), dtype), np.float32)
               for name in ("q", "k_cache", "v_cache")}
    return dataclasses.replace(case, **rounded)


def device_args(case: Case, dtype) -> tuple:
    """(q, k_cache, v_cache, block_table, seq_lens, query_start_loc) as jax arrays."""
    import jax.numpy as jnp  # noqa: PLC0415

    return (jnp.asarray(case.q, dtype), jnp.asarray(case.k_cache, dtype),
            jnp.asarray(case.v_cache, dtype), jnp.asarray(case.block_table),
            jnp.asarray(case.seq_lens), jnp.asarray(case.query_start_loc))
