"""Pure-jnp ragged paged attention: the CPU backend and the kernels' oracle.

Re-exported by ``pallas_kernels.ragged_paged_attention`` (the contract and
cache layout are described there). Work is organised so that its cost is
what the step needs, not T × (longest context):

* The step's T query tokens are processed in chunks of ``query_chunk``
  tokens (``lax.map``: one loop body in the program, whatever T is).
* Within a chunk, a token attends to (A) the chunk's own tokens of its row —
  a small causal ``[Tc, Tc]`` product — and (B) the earlier tokens of its row,
  read from the cache through the block table in tiles of ``context_tile``
  tokens by a ``while_loop`` whose trip count is the chunk's longest such
  context (0 for a chunk of fresh prefill tokens).
* (B) takes one of two paths at run time (``lax.cond``): when every row in
  the chunk is a prefill row (``_MIN_PREFILL_TOKENS`` query tokens or more
  in the step — a prefill chunk, or one straddling a few prompts), it goes
  row by row, each context tile gathered once and shared by that row's
  tokens — a plain matrix product, the other rows' tokens masked; otherwise
  (a decode row is in it) each token gathers its own row's tile.

(A) and (B) are merged with FlashAttention's online softmax (Dao et al.,
2022, Alg. 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Masked scores: finite so that a row with every key masked gives exp() == 0,
# not NaN. Source: the usual flash-attention convention (e.g. JAX's own
# pallas ops use a large negative finite DEFAULT_MASK_VALUE).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# A query chunk whose rows all bring at least this many query tokens to the step
# (prefill rows) reads each row's context once for all of its tokens (row by row);
# a chunk with any shorter row (decode) reads per token. Measured on this CPU
# (docs/model.md): row by row over decode rows cost more than reading per token.
_MIN_PREFILL_TOKENS = 4


def row_of_tokens(query_start_loc: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
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


def softcap(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    """Gemma-2 style logit soft cap: ``cap * tanh(s / cap)``."""
    if soft_cap is None:
        return scores
    return soft_cap * jnp.tanh(scores / soft_cap)


def _online_update(carry, scores, mask, soft_cap, weighted_values):
    """One online-softmax step.

    carry: (m, l [Tc, K, G], acc [Tc, K, G, H]); scores [Tc, K, G, C];
    mask bool[Tc, C]; ``weighted_values(p [Tc, K, G, C]) -> [Tc, K, G, H]``
    multiplies the probabilities by the tile's values (zeroed where masked).
    """
    m, l, acc = carry
    s = softcap(scores, soft_cap)
    s = jnp.where(mask[:, None, None, :], s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    l = l * alpha + jnp.sum(p, axis=-1)
    return m_new, l, acc * alpha[..., None] + weighted_values(p)


# Context tiles stay in the cache's own block layout, [..., nb, K, S, H]: the
# gather copies whole [K, S, H] blocks, and the products contract over
# (block, slot) without first moving K in front — on the CPU the transposed
# copy of every tile cost ~3× the products themselves (measured: 16 decode
# rows, 128-token tiles, 1.33 → 0.40 ms per tile).
def _shared_tile_scores(q: jax.Array, kt: jax.Array) -> jax.Array:
    """q [Tc, K, G, H], kt [nb, K, S, H] → [Tc, K, G, nb·S]."""
    s = jnp.einsum("tkgh,bksh->tkgbs", q, kt)
    return s.reshape(*s.shape[:3], -1)


def _shared_tile_values(p: jax.Array, vt: jax.Array) -> jax.Array:
    """p [Tc, K, G, nb·S], vt [nb, K, S, H] → [Tc, K, G, H]."""
    return jnp.einsum("tkgbs,bksh->tkgh", p.reshape(*p.shape[:3], vt.shape[0], vt.shape[2]), vt)


def _token_tile_scores(q: jax.Array, kt: jax.Array) -> jax.Array:
    """q [Tc, K, G, H], kt [Tc, nb, K, S, H] → [Tc, K, G, nb·S]."""
    s = jnp.einsum("tkgh,tbksh->tkgbs", q, kt)
    return s.reshape(*s.shape[:3], -1)


def _token_tile_values(p: jax.Array, vt: jax.Array) -> jax.Array:
    """p [Tc, K, G, nb·S], vt [Tc, nb, K, S, H] → [Tc, K, G, H]."""
    return jnp.einsum("tkgbs,tbksh->tkgh", p.reshape(*p.shape[:3], vt.shape[1], vt.shape[3]), vt)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "context_tile", "query_chunk"))
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
    query_chunk: int = 64,
) -> jax.Array:
    """Causal attention of ragged query rows over a paged KV cache, in pure jnp.

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
      context_tile: cached tokens read per loop iteration (rounded up to a
        multiple of S).
      query_chunk: query tokens processed together (Tc; min(T, query_chunk)).

    Returns:
      [T, N, H] attention output in q's dtype.

    Raises:
      ValueError: on inconsistent shapes or N not a multiple of K.
    """
    check_shapes(q, k_cache, v_cache, block_table, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    max_blocks = block_table.shape[1]
    group = num_heads // num_kv_heads
    chunk = min(query_chunk, num_tokens)
    num_chunks = -(-num_tokens // chunk)
    padded_tokens = num_chunks * chunk

    row, valid = row_of_tokens(query_start_loc, padded_tokens)  # [Tp]
    q_len = query_start_loc[1:] - query_start_loc[:-1]  # [R]
    ctx_len = seq_lens - q_len  # [R] tokens cached before this step
    t_idx = jnp.arange(padded_tokens, dtype=jnp.int32)
    pos = jnp.where(valid, ctx_len[row] + t_idx - query_start_loc[row], 0)  # [Tp]
    qf = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, head_dim)
    qf = jnp.pad(qf, ((0, padded_tokens - num_tokens), (0, 0), (0, 0), (0, 0)))

    blocks_per_tile = max(1, -(-context_tile // block_size))
    tile_tokens = blocks_per_tile * block_size
    padded_mb = -(-max_blocks // blocks_per_tile) * blocks_per_tile
    table = jnp.clip(jnp.pad(block_table, ((0, 0), (0, padded_mb - max_blocks))), 0, num_blocks - 1)

    def one_chunk(c: jax.Array) -> jax.Array:
        c0 = c * chunk
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, c0, chunk)  # noqa: E731
        qc, rc, vc, pc, tc = sl(qf), sl(row), sl(valid), sl(pos), sl(t_idx)  # [Tc, ...]
        # Keys before the first of the chunk's tokens of the same row come from (B).
        first = jnp.maximum(query_start_loc[rc], c0)  # [Tc] token index
        local_start = jnp.where(vc, pc - (tc - first), 0)  # [Tc] position
        lo = pc - sliding_window + 1 if sliding_window is not None else jnp.zeros_like(pc)

        # --- (A) the chunk's own tokens, read back from the cache at their slots.
        own = table[rc, jnp.clip(pc // block_size, 0, padded_mb - 1)]  # [Tc]
        k_own = jnp.where(vc[:, None, None], k_cache[own, :, pc % block_size].astype(jnp.float32), 0)
        v_own = jnp.where(vc[:, None, None], v_cache[own, :, pc % block_size].astype(jnp.float32), 0)
        mask = (rc[:, None] == rc[None, :]) & (tc[None, :] <= tc[:, None])
        mask &= vc[:, None] & vc[None, :] & (pc[None, :] >= lo[:, None])
        init = (jnp.full((chunk, num_kv_heads, group), MASK_VALUE, jnp.float32),
                jnp.zeros((chunk, num_kv_heads, group), jnp.float32),
                jnp.zeros((chunk, num_kv_heads, group, head_dim), jnp.float32))
        scores = jnp.einsum("tkgh,ukh->tkgu", qc, k_own)  # [Tc, K, G, Tc]
        carry = _online_update(init, scores, mask, soft_cap,
                               lambda p: jnp.einsum("tkgu,ukh->tkgh", p, v_own))

        # --- (B) earlier tokens of each row, from the cache through the block table.
        def num_tiles_of(starts):
            return (jnp.max(starts) + tile_tokens - 1) // tile_tokens

        def tile_mask(i, starts):
            kpos = i * tile_tokens + jnp.arange(tile_tokens, dtype=jnp.int32)  # [C]
            return (kpos[None, :] < starts[:, None]) & (kpos[None, :] >= lo[:, None])

        def shared_tile(state, row, starts):  # the chunk's tokens of ``row`` (others masked)
            i, carry = state
            ids = jax.lax.dynamic_slice_in_dim(table[row], i * blocks_per_tile, blocks_per_tile)
            kt = k_cache[ids].astype(jnp.float32)  # [nb, K, S, H]
            vt = v_cache[ids].astype(jnp.float32)
            m = tile_mask(i, starts)  # [Tc, C]
            used = m.any(0).reshape(blocks_per_tile, 1, block_size, 1)
            vt = jnp.where(used, vt, 0.0)  # unused slots may hold NaN
            return i + 1, _online_update(carry, _shared_tile_scores(qc, kt), m, soft_cap,
                                         lambda p: _shared_tile_values(p, vt))

        def per_token_tile(state):  # each token gathers its own row's tile
            i, carry = state
            ids = jax.lax.dynamic_slice_in_dim(table[rc], i * blocks_per_tile, blocks_per_tile, axis=1)
            kt = k_cache[ids].astype(jnp.float32)  # [Tc, nb, K, S, H]
            vt = v_cache[ids].astype(jnp.float32)
            m = tile_mask(i, local_start)
            vt = jnp.where(m.reshape(chunk, blocks_per_tile, 1, block_size, 1), vt, 0.0)
            return i + 1, _online_update(carry, _token_tile_scores(qc, kt), m, soft_cap,
                                         lambda p: _token_tile_values(p, vt))

        def tile_loop(tile_fn, num_tiles, carry):
            return jax.lax.while_loop(lambda s: s[0] < num_tiles, tile_fn, (jnp.int32(0), carry))[1]

        def per_token_rows(carry):  # each token gathers its own row's tiles
            return tile_loop(per_token_tile, num_tiles_of(local_start), carry)

        def row_by_row(carry):  # rows in turn, each row's tiles gathered once for its tokens
            def one_row(row, carry):
                starts = jnp.where(rc == row, local_start, 0)
                return tile_loop(lambda s: shared_tile(s, row, starts), num_tiles_of(starts), carry)
            return jax.lax.fori_loop(rc[0], last_row + 1, one_row, carry)

        # Rows are contiguous in token order, so the chunk holds rows rc[0] .. last_row.
        last_row = jnp.max(jnp.where(vc, rc, rc[0]))
        if chunk == 1:  # one token, one row: no loop over rows
            m, l, acc = tile_loop(lambda s: shared_tile(s, rc[0], local_start),
                                  num_tiles_of(local_start), carry)
        else:
            prefill_only = jnp.all(~vc | (q_len[rc] >= _MIN_PREFILL_TOKENS))
            m, l, acc = jax.lax.cond(prefill_only, row_by_row, per_token_rows, carry)
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]
        return jnp.where(vc[:, None, None, None], out, 0.0)  # [Tc, K, G, H]

    if num_chunks == 1:  # decode steps of up to query_chunk rows: no loop over chunks
        out = one_chunk(jnp.int32(0))
    else:
        out = jax.lax.map(one_chunk, jnp.arange(num_chunks, dtype=jnp.int32))
    out = out.reshape(padded_tokens, num_heads, head_dim)[:num_tokens]
    return out.astype(q.dtype)


def check_shapes(q, k_cache, v_cache, block_table, seq_lens, query_start_loc) -> None:
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
