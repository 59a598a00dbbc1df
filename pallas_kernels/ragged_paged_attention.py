"""Ragged paged attention: one call for all of a step's rows.

A step's tokens are grouped by row (request): row ``r`` owns the query tokens
``query_start_loc[r] : query_start_loc[r + 1]``, which are the *last* tokens
of its sequence of ``seq_lens[r]`` tokens. Earlier tokens of the row (its
context: prefix-cache hits, earlier prefill chunks, earlier decode steps) are
read from the paged KV cache through ``block_table[r]``; the step's own keys
and values must already have been written to the cache (see
``jaxserve.model.kv_cache.write_kv``). Attention is causal within each row.

KV cache layout (per layer; see docs/kv_cache.md): ``k_cache`` and ``v_cache``
are ``[B, K, S, H]`` — blocks, KV heads, block slots, head dim. Putting the
KV heads before the slots lets a kernel (and XLA on the CPU) read one head's
block as one contiguous ``[S, H]`` tile with no transposes (CPU_PERF.md).
Token ``p`` of a row lives in block ``block_table[r, p // S]`` at slot
``p % S``.

This module holds the two implementations of that contract:
``ragged_paged_attention`` — the Pallas GPU kernel (Triton lowering; its body
and schedule are in ``pallas_kernels.rpa_kernel``, its tunables in
``pallas_kernels.tuning``) — and ``ragged_paged_attention_reference``, the
pure-``jnp`` reference, which is the CPU backend and the oracle of every
kernel test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import rpa_kernel
from pallas_kernels.tuning import TuningConfig, tuning_for

# Masked scores: finite so that a row with every key masked gives exp() == 0,
# not NaN. Source: the usual flash-attention convention (e.g. JAX's own
# pallas ops use a large negative finite DEFAULT_MASK_VALUE).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _row_of_tokens(query_start_loc: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Row index of every token and whether the token belongs to any row.

    Args:
      query_start_loc: i32[R + 1], non-decreasing, ``query_start_loc[0] == 0``.
      num_tokens: T, the (padded) number of query tokens.

    Returns:
      (row i32[T], valid bool[T]); padding tokens (``t >= query_start_loc[R]``)
      get ``valid == False`` and row ``R - 1``.
    """
    num_rows = query_start_loc.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.searchsorted(query_start_loc, t, side="right").astype(jnp.int32) - 1
    row = jnp.clip(row, 0, num_rows - 1)
    valid = t < query_start_loc[num_rows]
    return row, valid


def _softcap(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    """Gemma-2 style logit soft cap: ``cap * tanh(s / cap)``."""
    if soft_cap is None:
        return scores
    return soft_cap * jnp.tanh(scores / soft_cap)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "context_tile"))
def ragged_paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    context_tile: int = 128,
) -> jax.Array:
    """Causal attention of ragged query rows over a paged KV cache, in pure jnp.

    Two parts, merged with the online-softmax (log-sum-exp) rule of
    FlashAttention (Dao et al., 2022, Alg. 1):

    1. *In-step keys*: every query against the step's own tokens of its row
       (a block-diagonal causal ``[T, T]`` score matrix). Cheap for decode
       steps and for fresh prefills, which have no context.
    2. *Context keys*: every query against the tokens of its row that were in
       the cache before this step, read through the block table in tiles of
       ``context_tile`` tokens by a ``while_loop`` whose trip count is the
       longest context of the step (not the maximum model length).

    Args:
      q: [T, N, H] queries (RoPE applied), float32 or bfloat16.
      k_cache: [B, K, S, H] keys of one layer, the step's keys already written.
      v_cache: [B, K, S, H] values of one layer, likewise.
      block_table: i32[R, MB]; entries past a row's last block are ignored.
      seq_lens: i32[R], tokens of each row including this step's (0 = padding row).
      query_start_loc: i32[R + 1], row ``r``'s queries are
        ``q[query_start_loc[r]:query_start_loc[r + 1]]``; tokens at or past
        ``query_start_loc[R]`` are padding and give zeros.
      sm_scale: softmax scale, usually ``H ** -0.5``.
      sliding_window: if set, a query at position p sees keys at positions
        ``> p - sliding_window`` only (Mistral's convention).
      soft_cap: if set, scores become ``soft_cap * tanh(scores / soft_cap)``.
      context_tile: context tokens read per loop iteration (rounded up to a
        multiple of S).

    Returns:
      [T, N, H] attention output in q's dtype.

    Raises:
      ValueError: on inconsistent shapes or N not a multiple of K.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    num_rows, max_blocks = block_table.shape
    _check_shapes(q, k_cache, v_cache, block_table, seq_lens, query_start_loc)
    group = num_heads // num_kv_heads

    row, valid = _row_of_tokens(query_start_loc, num_tokens)  # [T], [T]
    q_len = query_start_loc[1:] - query_start_loc[:-1]  # [R]
    ctx_len = seq_lens - q_len  # [R] tokens cached before this step
    t_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    pos = ctx_len[row] + t_idx - query_start_loc[row]  # [T] position of each query
    pos = jnp.where(valid, pos, 0)
    qf = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, head_dim)

    # --- 1. in-step keys, read back from the cache at each token's own slot.
    bt_tok = block_table[row]  # [T, MB]
    own_block = jnp.take_along_axis(
        bt_tok, jnp.clip(pos // block_size, 0, max_blocks - 1)[:, None], axis=1)[:, 0]
    own_block = jnp.clip(own_block, 0, num_blocks - 1)
    k_step = k_cache[own_block, :, pos % block_size].astype(jnp.float32)  # [T, K, H]
    v_step = v_cache[own_block, :, pos % block_size].astype(jnp.float32)  # [T, K, H]
    k_step = jnp.where(valid[:, None, None], k_step, 0.0)
    v_step = jnp.where(valid[:, None, None], v_step, 0.0)
    s = jnp.einsum("tkgh,ukh->tkgu", qf, k_step)  # [T, K, G, T]
    s = _softcap(s, soft_cap)
    mask = (row[:, None] == row[None, :]) & (t_idx[None, :] <= t_idx[:, None])
    mask &= valid[:, None] & valid[None, :]
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    s = jnp.where(mask[:, None, None, :], s, MASK_VALUE)
    m = jnp.max(s, axis=-1)  # [T, K, G]
    p = jnp.exp(s - m[..., None])
    l = jnp.sum(p, axis=-1)  # [T, K, G]
    acc = jnp.einsum("tkgu,ukh->tkgh", p, v_step)  # [T, K, G, H]

    # --- 2. context keys through the block table, tile by tile.
    blocks_per_tile = max(1, -(-context_tile // block_size))
    tile_tokens = blocks_per_tile * block_size
    ctx_tok = jnp.where(valid, ctx_len[row], 0)  # [T]
    num_tiles = (jnp.max(ctx_tok) + tile_tokens - 1) // tile_tokens
    # Pad the table so that the last tile's dynamic slice stays in range.
    padded_mb = -(-max_blocks // blocks_per_tile) * blocks_per_tile
    bt_tok = jnp.pad(bt_tok, ((0, 0), (0, padded_mb - max_blocks)))
    lo = (pos - sliding_window + 1) if sliding_window is not None else jnp.zeros_like(pos)

    def body(carry):
        i, m, l, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(bt_tok, i * blocks_per_tile, blocks_per_tile, axis=1)
        ids = jnp.clip(ids, 0, num_blocks - 1)  # [T, blocks_per_tile]
        kpos = i * tile_tokens + jnp.arange(tile_tokens, dtype=jnp.int32)  # [C]
        kmask = (kpos[None, :] < ctx_tok[:, None]) & (kpos[None, :] >= lo[:, None])  # [T, C]
        kt = k_cache[ids].astype(jnp.float32)  # [T, bpt, K, S, H]
        vt = v_cache[ids].astype(jnp.float32)
        kt = jnp.moveaxis(kt, 2, 1).reshape(num_tokens, num_kv_heads, tile_tokens, head_dim)
        vt = jnp.moveaxis(vt, 2, 1).reshape(num_tokens, num_kv_heads, tile_tokens, head_dim)
        # Unused cache slots may hold anything (NaN in tests): zero them so
        # that 0 * NaN never reaches the accumulator.
        vt = jnp.where(kmask[:, None, :, None], vt, 0.0)
        st = jnp.einsum("tkgh,tkch->tkgc", qf, kt)  # [T, K, G, C]
        st = _softcap(st, soft_cap)
        st = jnp.where(kmask[:, None, None, :], st, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(st, axis=-1))
        alpha = jnp.exp(m - m_new)
        pt = jnp.exp(st - m_new[..., None])
        l = l * alpha + jnp.sum(pt, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgc,tkch->tkgh", pt, vt)
        return i + 1, m_new, l, acc

    _, m, l, acc = jax.lax.while_loop(
        lambda c: c[0] < num_tiles, body, (jnp.int32(0), m, l, acc))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _check_shapes(q, k_cache, v_cache, block_table, seq_lens, query_start_loc) -> None:
    """Raises ValueError unless the arrays fit ragged_paged_attention's contract."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, N, H], got shape {q.shape}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [B, K, S, H], got {k_cache.shape} and {v_cache.shape}")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, cache has {k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"N={num_heads} query heads is not a multiple of K={num_kv_heads}")
    if block_table.ndim != 2:
        raise ValueError(f"block_table must be [R, MB], got shape {block_table.shape}")
    num_rows = block_table.shape[0]
    if seq_lens.shape != (num_rows,):
        raise ValueError(f"seq_lens must be [R]=[{num_rows}], got {seq_lens.shape}")
    if query_start_loc.shape != (num_rows + 1,):
        raise ValueError(f"query_start_loc must be [R + 1]=[{num_rows + 1}], got {query_start_loc.shape}")


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "tuning"))
def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    tuning: TuningConfig | None = None,
) -> jax.Array:
    """Causal attention of ragged query rows over a paged KV cache: the Pallas kernel.

    Same contract and results as ``ragged_paged_attention_reference`` (decode
    rows, prefill chunks and prefills continuing after cached blocks in one
    call; GQA with any N / K, padded to a power of two inside the kernel).
    Decode-shaped steps (``T <= tuning.decode_max_tokens``) that cannot fill
    the GPU with one program per (row, KV head) split each row's keys
    (flash-decoding) and merge the partials in a combine step.

    Args:
      q: [T, N, H] queries (RoPE applied), bfloat16 or float32.
      k_cache: [B, K, S, H] keys of one layer in q's dtype, the step's keys
        already written; block 0 is the null block.
      v_cache: [B, K, S, H] values of one layer, likewise.
      block_table: i32[R, MB]; entries past a row's last block are never read.
      seq_lens: i32[R], tokens of each row including this step's (0 = padding row).
      query_start_loc: i32[R + 1], non-decreasing from 0; row r's queries are
        ``q[query_start_loc[r]:query_start_loc[r + 1]]`` and are the last
        tokens of its sequence; tokens at or past ``query_start_loc[R]`` are
        padding and give zeros.
      sm_scale: softmax scale, usually ``H ** -0.5``.
      sliding_window: if set, a query at position p sees keys at positions
        ``> p - sliding_window`` only.
      soft_cap: if set, scores become ``soft_cap * tanh(scores / soft_cap)``.
      interpret: run in Pallas interpret mode (any backend, e.g. CPU tests).
      tuning: kernel variant; default ``tuning_for(H, S, dtype)``.

    Returns:
      [T, N, H] attention output in q's dtype.

    Raises:
      ValueError: on inconsistent shapes, N not a multiple of K, or q and the
        cache in different dtypes.
      NotImplementedError: H not a power of two >= 16, or a dtype other than
        bfloat16 / float32.
    """
    _check_shapes(q, k_cache, v_cache, block_table, seq_lens, query_start_loc)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
            f"{v_cache.dtype}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if tuning is None:
        tuning = tuning_for(q.shape[2], k_cache.shape[2], q.dtype)
    return rpa_kernel.ragged_paged_attention_pallas(
        q, k_cache, v_cache, block_table, seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32), sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, tuning=tuning, interpret=interpret)
