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
block as one contiguous ``[S, H]`` tile with no transposes (docs/kv_cache.md).
Token ``p`` of a row lives in block ``block_table[r, p // S]`` at slot
``p % S``.

This module holds the two implementations of that contract:
``ragged_paged_attention`` — the Pallas GPU kernel (Triton lowering; its body
and schedule are in ``pallas_kernels.rpa_kernel``, its tunables in
``pallas_kernels.tuning``) — and ``ragged_paged_attention_reference``, the
pure-``jnp`` reference (``pallas_kernels.rpa_reference``, re-exported here),
which is the CPU backend and the oracle of every kernel test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import rpa_kernel
from pallas_kernels.rpa_reference import check_shapes, ragged_paged_attention_reference
from pallas_kernels.tuning import TuningConfig, tuning_for

__all__ = ["attention_schedule", "ragged_paged_attention", "ragged_paged_attention_reference"]


def attention_schedule(query_start_loc: jax.Array, seq_lens: jax.Array, *, num_tokens: int,
                       num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype,
                       tuning: TuningConfig | None = None) -> jax.Array:
    """The kernel's tile schedule for one step, to compute once and pass to every layer.

    Every layer's call of a step shares the metadata, so the schedule (which
    query tokens each program serves: a few small XLA ops, T x (R + 1)
    compares and no loop) can be computed once per step and handed to each
    ``ragged_paged_attention`` call as ``tiles``.

    Args:
      query_start_loc: i32[R + 1]. seq_lens: i32[R].
      num_tokens: T. num_heads: N. num_kv_heads: K. head_dim: H. block_size: S.
      dtype: q's dtype (the cache's, or wider for an fp8 cache). tuning: as
        ``ragged_paged_attention``.

    Returns:
      i32[NT, 5] with NT = ``num_query_tiles(T, R, block_q)`` (see
      ``rpa_kernel.tile_schedule``).
    """
    if tuning is None:
        tuning = tuning_for(head_dim, block_size, dtype)
    block_q = rpa_kernel.query_block(tuning, num_tokens=num_tokens, num_heads=num_heads,
                                     num_kv_heads=num_kv_heads)
    return rpa_kernel.tile_schedule(query_start_loc, seq_lens, num_tokens=num_tokens,
                                    block_q=block_q)


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
    tiles: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of ragged query rows over a paged KV cache: the Pallas kernel.

    Same contract and results as ``ragged_paged_attention_reference`` (decode
    rows, prefill chunks and prefills continuing after cached blocks in one
    call; GQA with any N / K and any head dim H, each padded to a power of two
    inside the kernel).
    Decode-shaped steps (``T <= tuning.decode_max_tokens``) that cannot fill
    the GPU with one program per (row, KV head) split each row's keys
    (flash-decoding) and merge the partials in a combine step.

    Args:
      q: [T, N, H] queries (RoPE applied), bfloat16 or float32.
      k_cache: [B, K, S, H] keys of one layer in q's dtype or float8_e4m3fn (an
        fp8 cache: each tile is widened to q's dtype as it is read, unscaled —
        a scale is the caller's), the step's keys already written; block 0 is
        the null block.
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
      tuning: kernel variant; default ``tuning_for(H, S, q.dtype)``.
      tiles: i32[NT, 5], the step's ``attention_schedule`` (same tuning)
        computed once for all layers; None computes it in this call.

    Returns:
      [T, N, H] attention output in q's dtype.

    Raises:
      ValueError: on inconsistent shapes (``tiles`` included), N not a
        multiple of K, or a cache neither in q's dtype nor float8_e4m3fn (or
        k_cache and v_cache in different dtypes).
      NotImplementedError: a dtype other than bfloat16 / float32. (Any H works:
        the kernel pads it to ``padded_head_dim(H)`` and masks the extra columns.)
    """
    check_shapes(q, k_cache, v_cache, block_table, seq_lens, query_start_loc)
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, jnp.float8_e4m3fn):
        raise ValueError(
            f"k_cache and v_cache must share q's dtype or be float8_e4m3fn, got q "
            f"{q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if tuning is None:
        tuning = tuning_for(q.shape[2], k_cache.shape[2], q.dtype)
    if tiles is not None:
        num_tokens, num_heads, _ = q.shape
        block_q = rpa_kernel.query_block(tuning, num_tokens=num_tokens, num_heads=num_heads,
                                         num_kv_heads=k_cache.shape[1])
        want = (rpa_kernel.num_query_tiles(num_tokens, seq_lens.shape[0], block_q), 5)
        if tiles.shape != want or tiles.dtype != jnp.int32:
            raise ValueError(f"tiles must be i32{list(want)} (attention_schedule with the same "
                             f"tuning), got {tiles.dtype}{list(tiles.shape)}")
    return rpa_kernel.ragged_paged_attention_pallas(
        q, k_cache, v_cache, block_table, seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32), sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, tuning=tuning, interpret=interpret, tiles=tiles)
