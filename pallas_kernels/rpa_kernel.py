"""The Pallas (Triton) kernel behind ``ragged_paged_attention``.

The public entry point, its contract and its pure-jnp reference live in
``pallas_kernels.ragged_paged_attention``; this module holds the pieces that
run on the GPU: the tile schedule (which program serves which query tokens),
the kernel body, its ``pallas_call`` with a ``CostEstimate``, and the split-K
combine step.

Grid: ``(NT, K, NS)`` — query tiles x KV heads x KV splits. A query tile is up
to ``block_q`` consecutive tokens of one row; with the row's GQA group of G
query heads (padded inside the kernel to a power of two, G_pad) it makes a
``[block_q * G_pad, H]`` matrix, so one program reads each K/V tile of its row
once for all the query heads that share the KV head. A head dim H that is
not a power of two (80, 96, ...) is padded inside the kernel to the tile width
H_pad = ``padded_head_dim(H)``: the extra columns are masked on every load
(read as 0, so they add nothing to q·k and give 0 in p·v) and on every store
(never written). Tokens past the last row
(padding) form one more pseudo-row with no keys, whose programs write zeros.
NT is a static bound (``num_query_tiles``); programs past the step's real
tiles have no tokens and do nothing.

Keys are read in tiles of ``block_kv`` tokens, gathered token by token through
the block table (``block_table[r, p // S]``, slot ``p % S``), so the tile is
independent of the block size and NaN-filled or foreign blocks are never read
(masked loads). Scores use the online softmax of FlashAttention-2 (Dao, 2023)
in base 2 (``exp2`` with log2(e) folded into the scores). With NS > 1 each
program covers 1/NS of its row's key range and writes unnormalised partials
(acc, running max m, sum l); ``combine_splits`` merges them (flash-decoding,
Dao et al., 2023).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tuning import TuningConfig, next_pow2, num_kv_splits, padded_head_dim

LOG2E = math.log2(math.e)
# Finite, so that exp2(MASK - m) is 0 and never NaN (JAX's pallas ops use the same).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# jax >= 0.11 warns at every Triton lowering that the Pallas Triton backend is
# deprecated in favour of Mosaic GPU. The kernel is Triton on purpose (see
# docs/kernels.md); silence exactly that message, nothing else.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)
# Columns of the tile schedule, i32[NT, 5].
_ROW, _Q_START, _Q_END, _KV_LEN, _POS_OFFSET = range(5)


def num_query_tiles(num_tokens: int, num_rows: int, block_q: int) -> int:
    """Static bound on the query tiles of a step: NT = min(T, ceil(T / block_q) + R).

    The step's T tokens fall into R + 1 segments (the R rows and the padding
    pseudo-row), segment i holding len_i tokens with sum_i len_i = T; segment i
    needs ceil(len_i / block_q) tiles. Since ceil(a) + ceil(b) <= ceil(a + b) + 1,
    the R + 1 segments need at most ceil(T / block_q) + R tiles; and a segment
    with tokens needs at most one tile per token, so at most T in all. Rows
    with no tokens (padding rows) need no tile, so NT never exceeds T whatever
    R (the worker's R = min(T, max_num_seqs)): a batch-1 decode in the T = 1
    bucket is one tile at any ``max_num_seqs``.
    """
    return min(num_tokens, -(-num_tokens // block_q) + num_rows)


def query_block(tuning: TuningConfig, *, num_tokens: int, num_heads: int,
                num_kv_heads: int) -> int:
    """Tokens per query tile (block_q) of one call: the tile's M rows over pow2(G)."""
    group_pad = next_pow2(num_heads // num_kv_heads)
    return max(tuning.launch(num_tokens).block_m, group_pad) // group_pad


def tile_schedule(query_start_loc: jax.Array, seq_lens: jax.Array, *, num_tokens: int,
                  block_q: int) -> jax.Array:
    """Which tokens each query tile serves, computed on device from the metadata.

    Args:
      query_start_loc: i32[R + 1]. seq_lens: i32[R].
      num_tokens: T. block_q: tokens per tile.

    Returns:
      i32[NT, 5]: per tile ``(row, q_start, q_end, kv_len, pos_offset)``:
      tokens ``q_start <= t < q_end`` of block-table row ``row`` (clamped to
      R - 1 for the padding pseudo-row), which has ``kv_len`` keys; token t is
      at position ``t + pos_offset``. Unused tiles have ``q_start == q_end``
      and ``kv_len == 0``.
    """
    num_rows = seq_lens.shape[0]
    qsl = query_start_loc.astype(jnp.int32)
    end = qsl[num_rows]
    starts = jnp.concatenate([qsl[:-1], end[None]])  # [R + 1]
    lens = jnp.concatenate([qsl[1:] - qsl[:-1], (num_tokens - end)[None]])
    lens = jnp.maximum(lens, 0)  # [R + 1]; the last is the padding pseudo-row
    kv_len = jnp.concatenate([seq_lens.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    tiles_per_row = (lens + block_q - 1) // block_q  # [R + 1]
    last = jnp.cumsum(tiles_per_row)  # [R + 1] one past each row's last tile
    tile = jnp.arange(num_query_tiles(num_tokens, num_rows, block_q), dtype=jnp.int32)
    # Rows whose tiles end at or before each tile (a search by comparing against every
    # row: a binary search would lower to a while loop, which a GPU runs by syncing the host).
    row = jnp.sum(last[None, :] <= tile[:, None], axis=1, dtype=jnp.int32)  # [NT] in [0, R + 1]
    live = row <= num_rows
    row = jnp.minimum(row, num_rows)
    q_start = starts[row] + (tile - (last[row] - tiles_per_row[row])) * block_q
    row_end = starts[row] + lens[row]
    q_end = jnp.minimum(q_start + block_q, row_end)
    return jnp.stack([
        jnp.minimum(row, num_rows - 1),
        jnp.where(live, q_start, 0),
        jnp.where(live, q_end, 0),
        jnp.where(live, kv_len[row], 0),
        kv_len[row] - row_end,
    ], axis=1)


def _rpa_kernel(tiles_ref, block_table_ref, q_ref, k_ref, v_ref, *out_refs, num_heads: int,
                num_kv_heads: int, block_q: int, block_kv: int, block_size: int, max_blocks: int,
                sm_scale: float, sliding_window: int | None, soft_cap: float | None,
                num_splits: int):
    # tiles_ref:       i32[NT, 5]  (tile_schedule)
    # block_table_ref: i32[R, MB]
    # q_ref:           [T·N, H]    q viewed flat: token t, head n at row t·N + n
    # k_ref, v_ref:    [B·K·S, H]  cache viewed flat: block b, KV head k, slot s
    #                              at row (b·K + k)·S + s; q's dtype or fp8 (widened)
    # out_refs, NS == 1: o_ref [T·N, H] in q's dtype
    #           NS > 1:  acc_ref f32[NS, T·N, H], m_ref f32[NS, T·N], l_ref f32[NS, T·N]
    tile, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = tiles_ref[tile, _ROW]
    q_start = tiles_ref[tile, _Q_START]
    q_end = tiles_ref[tile, _Q_END]
    kv_len = tiles_ref[tile, _KV_LEN]
    pos_offset = tiles_ref[tile, _POS_OFFSET]
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    block_m = block_q * group_pad
    head_dim = q_ref.shape[1]
    num_q_rows = q_ref.shape[0]
    head_pad = padded_head_dim(head_dim)

    lane = jnp.arange(block_m, dtype=jnp.int32)  # [M] query rows of the tile: token-major
    token = q_start + lane // group_pad  # [M]
    g = lane % group_pad  # [M] head within the group; >= group is GQA padding
    row_ok = (token < q_end) & (g < group)  # [M]
    # Masked lanes point past the array (distinct, never dereferenced): masked
    # stores of interpret mode then drop them instead of racing real rows.
    q_rows = jnp.where(row_ok, token * num_heads + kv_head * group + g, num_q_rows + lane)  # [M]
    q_pos = token + pos_offset  # [M] position of each query in its sequence
    cols = jnp.arange(head_pad, dtype=jnp.int32)  # [H_pad]; columns >= H are padding
    col_ok = cols < head_dim  # [H_pad]
    q_mask = row_ok[:, None] & col_ok[None, :]  # [M, H_pad]
    q = plgpu.load(q_ref.at[q_rows[:, None], cols[None, :]], mask=q_mask,
                   other=0.0)  # [M, H_pad]

    # Keys this program reads: causal up to the tile's last query, from the
    # sliding window's start (aligned to block_kv), then this split's share.
    hi = jnp.minimum(kv_len, q_end + pos_offset)
    lo = jnp.int32(0)
    if sliding_window is not None:
        lo = jnp.maximum(q_start + pos_offset - sliding_window + 1, 0)
        lo = (lo // block_kv) * block_kv
    num_iters = jnp.maximum((hi - lo + block_kv - 1) // block_kv, 0)
    # Split s takes iterations [s·n / NS, (s + 1)·n / NS): shares differ by at most one
    # tile, and a split is empty only when the tile has fewer than NS key tiles.
    it_lo = (split * num_iters) // num_splits
    it_hi = ((split + 1) * num_iters) // num_splits

    def key_positions(it):  # [BKV] positions of key tile ``it`` and which are live
        k_pos = lo + it * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        return k_pos, k_pos < hi

    def block_ids(it):  # [BKV] physical block of each key of tile ``it`` (0 past hi)
        k_pos, kv_ok = key_positions(it)
        col = jnp.minimum(k_pos // block_size, max_blocks - 1)
        return plgpu.load(block_table_ref.at[row, col], mask=kv_ok, other=0)

    def body(it, carry):
        # m [M], l [M], acc [M, H_pad] f32 (m in log2 units); blk [BKV] this tile's block
        # ids, read one iteration ahead so that the K/V gathers need not wait for the
        # block-table load (software pipelining of the table read).
        m, l, acc, blk = carry
        next_blk = block_ids(it + 1)  # masked past hi: never reads past the row
        k_pos, kv_ok = key_positions(it)  # [BKV]
        kv_rows = (blk * num_kv_heads + kv_head) * block_size + k_pos % block_size
        kv_rows = jnp.where(kv_ok, kv_rows, 0)  # [BKV]
        kv_mask = kv_ok[:, None] & col_ok[None, :]  # [BKV, H_pad]
        k = plgpu.load(k_ref.at[kv_rows[:, None], cols[None, :]], mask=kv_mask,
                       other=0.0).astype(q.dtype)  # [BKV, H_pad]; an fp8 cache widened
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * sm_scale  # [M, BKV]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = kv_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])  # [M, BKV]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.where(mask, s * LOG2E, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [M]
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)  # [M, BKV] f32
        l = l * alpha + jnp.sum(p, axis=1)
        v = plgpu.load(v_ref.at[kv_rows[:, None], cols[None, :]], mask=kv_mask,
                       other=0.0).astype(q.dtype)  # [BKV, H_pad]
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [M, H_pad]
        return m_new, l, acc * alpha[:, None] + pv, next_blk

    init = (jnp.full((block_m,), MASK_VALUE, jnp.float32), jnp.zeros((block_m,), jnp.float32),
            jnp.zeros((block_m, head_pad), jnp.float32), block_ids(it_lo))
    m, l, acc, _ = jax.lax.fori_loop(it_lo, it_hi, body, init)

    if num_splits == 1:
        (o_ref,) = out_refs
        out = acc / jnp.where(l > 0.0, l, 1.0)[:, None]  # rows with no keys (padding) give 0
        plgpu.store(o_ref.at[q_rows[:, None], cols[None, :]], out.astype(o_ref.dtype),
                    mask=q_mask)
    else:
        acc_ref, m_ref, l_ref = out_refs
        plgpu.store(acc_ref.at[split, q_rows[:, None], cols[None, :]], acc, mask=q_mask)
        plgpu.store(m_ref.at[split, q_rows], m, mask=row_ok)
        plgpu.store(l_ref.at[split, q_rows], l, mask=row_ok)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array, dtype) -> jax.Array:
    """Merges split-K partials (the final step of flash-decoding).

    Args:
      acc: f32[NS, T·N, H] unnormalised outputs; m: f32[NS, T·N] running
        maxima of the base-2 scores; l: f32[NS, T·N] sums of exp2(s - m).
      dtype: output dtype.

    Returns:
      [T·N, H]: sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s;
      0 where no split saw a key (padding tokens).
    """
    m_max = jnp.max(m, axis=0)  # [T·N]
    w = jnp.exp2(m - m_max[None])  # [NS, T·N]
    l_sum = jnp.sum(w * l, axis=0)
    out = jnp.sum(w[..., None] * acc, axis=0) / jnp.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    return out.astype(dtype)


def cost_estimate(*, num_tokens: int, num_rows: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, max_blocks: int, block_size: int, itemsize: int,
                  num_splits: int, soft_cap: bool, kv_itemsize: int | None = None
                  ) -> pl.CostEstimate:
    """A decode-shaped upper estimate of one call's work.

    Assumes every live row (at most ``min(T, R)``) reads the full context the
    block table can address (``MB * S`` tokens) once per KV head,
    and every query attends to ``MB * S`` keys: exact for decode rows at
    full context, an over-estimate for shorter rows and for causal prefill.

    Bytes: K and V ``2 * min(T, R) * K * MB * S * H * kv_itemsize`` (the cache's;
    default ``itemsize``, q's), plus q and the output (``T * N * H * itemsize`` each; f32 partials with m and l per
    split under split-K, written once and read once by the combine), the live
    rows of the block table and the tile schedule.
    """
    live_rows = min(num_tokens, num_rows)
    max_context = max_blocks * block_size
    kv_bytes = 2 * live_rows * num_kv_heads * max_context * head_dim * (kv_itemsize or itemsize)
    q_bytes = num_tokens * num_heads * head_dim * itemsize
    out_bytes = q_bytes
    if num_splits > 1:
        out_bytes = 2 * num_splits * num_tokens * num_heads * (head_dim + 2) * 4
    table_bytes = 4 * (live_rows * max_blocks + 5 * num_rows)
    scores = num_tokens * num_heads * max_context
    return pl.CostEstimate(
        flops=4 * scores * head_dim,
        transcendentals=scores * (2 if soft_cap else 1),
        bytes_accessed=kv_bytes + q_bytes + out_bytes + table_bytes,
    )


@functools.partial(jax.named_call, name="ragged_paged_attention_pallas")
def ragged_paged_attention_pallas(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *,
                                  sm_scale: float, sliding_window: int | None,
                                  soft_cap: float | None, tuning: TuningConfig,
                                  interpret: bool, tiles: jax.Array | None = None) -> jax.Array:
    """Runs the kernel (and the split-K combine); arguments as ``ragged_paged_attention``.

    Shapes (``tiles`` included) are assumed checked by the caller; ``tiles``
    None computes the tile schedule here. Returns [T, N, H] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    num_rows, max_blocks = block_table.shape
    launch = tuning.launch(num_tokens)
    group_pad = next_pow2(num_heads // num_kv_heads)
    block_q = query_block(tuning, num_tokens=num_tokens, num_heads=num_heads,
                          num_kv_heads=num_kv_heads)
    block_m = block_q * group_pad
    num_splits = num_kv_splits(tuning, num_tokens=num_tokens, num_rows=num_rows,
                               num_kv_heads=num_kv_heads, max_context=max_blocks * block_size)
    if tiles is None:
        tiles = tile_schedule(query_start_loc, seq_lens, num_tokens=num_tokens, block_q=block_q)
    num_q_rows = num_tokens * num_heads
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((num_q_rows, head_dim), q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((num_splits, num_q_rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, num_q_rows), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, num_q_rows), jnp.float32))
    kernel = functools.partial(
        _rpa_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, block_q=block_q,
        block_kv=launch.block_kv, block_size=block_size, max_blocks=max_blocks,
        sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        num_splits=num_splits)
    grid = (tiles.shape[0], num_kv_heads, num_splits)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=launch.num_warps,
                                             num_stages=launch.num_stages),
        cost_estimate=cost_estimate(
            num_tokens=num_tokens, num_rows=num_rows, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, max_blocks=max_blocks,
            block_size=block_size, itemsize=q.dtype.itemsize,
            kv_itemsize=k_cache.dtype.itemsize, num_splits=num_splits,
            soft_cap=soft_cap is not None),
        interpret=interpret,
        name=f"ragged_paged_attention_m{block_m}_kv{launch.block_kv}_s{num_splits}",
    )(tiles, block_table.astype(jnp.int32), q.reshape(num_q_rows, head_dim),
      k_cache.reshape(num_blocks * num_kv_heads * block_size, head_dim),
      v_cache.reshape(num_blocks * num_kv_heads * block_size, head_dim))
    if num_splits > 1:
        out = combine_splits(*out, q.dtype)
    return out.reshape(num_tokens, num_heads, head_dim)
