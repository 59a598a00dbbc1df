"""Tunables of the Pallas ragged paged attention kernel and their default table.

A variant of the kernel is a ``TuningConfig`` (a static argument), never a
separate kernel: block sizes, Triton's ``num_warps`` / ``num_stages`` and the
split-K cap for flash-decoding. ``DEFAULT_TUNING`` is keyed by
``(head_dim, block_size, dtype name)``; every entry is lowered for ``cuda`` in
the default test suite and compiled for an H100 in the ``h100`` tier
(scripts/h100_compile_env.sh), which is what caught shared-memory overflows
while the table was written (docs/kernels.md has the numbers).

Legend (docs/kernels.md): T tokens, R rows, N query heads, K KV heads,
G = N / K, H head dim, S block size.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# Streaming multiprocessors of an H100 SXM (core_count in
# pallas_kernels/h100_target_config.pbtxt). Split-K aims for two programs per SM.
H100_NUM_SMS = 132


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """One variant of the ragged paged attention kernel.

    Attributes:
      block_m: query rows of one program in prefill-shaped steps: tokens x
        padded GQA group (G rounded up to a power of two), so a program holds
        ``block_m // pow2(G)`` tokens of one row. Power of two, >= 16 (the
        smallest Triton ``dot``).
      decode_block_m: the same for decode-shaped steps (``T <= decode_max_tokens``):
        small, so that a one-token decode row wastes little of its tile.
      block_kv: keys per inner-loop iteration (a tile gathered through the
        block table token by token, so it need not divide the block size).
        Power of two, >= 16.
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the K/V loads.
      k_splits: most KV splits (flash-decoding) of a decode-shaped step; 1
        disables split-K. The split count actually used is
        ``num_kv_splits(...)``.
      decode_max_tokens: steps of at most this many tokens count as
        decode-shaped (0: none).
    """

    block_m: int = 64
    decode_block_m: int = 16
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    k_splits: int = 8
    decode_max_tokens: int = 256

    def __post_init__(self):
        for name in ("block_m", "decode_block_m", "block_kv"):
            value = getattr(self, name)
            if not _is_pow2(value) or value < 16:
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages < 1 or self.k_splits < 1 or self.decode_max_tokens < 0:
            raise ValueError(
                f"num_stages and k_splits must be >= 1, decode_max_tokens >= 0: {self}")


def _entries() -> dict[tuple[int, int, str], TuningConfig]:
    """The default table, one entry per (head_dim, block_size, dtype name).

    bfloat16 keeps K/V tiles of 64 keys x H in two pipeline stages (64 KiB of
    shared memory at H = 256); float32 tiles are twice as wide per key, so
    they halve block_kv (and block_m at H = 256) to stay within the H100's
    227 KiB of shared memory per block with room for the q tile and the
    layout conversions of ``dot``. The KV tile never goes below one cache
    block, so that one block-table entry serves whole rows of the tile.
    """
    table = {}
    for block_size in (16, 32, 64):
        for head_dim, bf16, f32 in (
            (64, TuningConfig(block_m=64, block_kv=64, num_warps=4, num_stages=3),
                 TuningConfig(block_m=64, block_kv=32, num_warps=4, num_stages=2)),
            (128, TuningConfig(block_m=64, block_kv=64, num_warps=4, num_stages=2),
                  TuningConfig(block_m=32, block_kv=32, num_warps=4, num_stages=2)),
            (256, TuningConfig(block_m=64, block_kv=32, num_warps=8, num_stages=2),
                  TuningConfig(block_m=32, block_kv=32, num_warps=8, num_stages=1)),
        ):
            for dtype, cfg in (("bfloat16", bf16), ("float32", f32)):
                cfg = dataclasses.replace(cfg, block_kv=max(cfg.block_kv, block_size))
                table[(head_dim, block_size, dtype)] = cfg
    return table


DEFAULT_TUNING: dict[tuple[int, int, str], TuningConfig] = _entries()


def tuning_for(head_dim: int, block_size: int, dtype) -> TuningConfig:
    """The default tuning for one cache geometry.

    Args:
      head_dim: H. block_size: S (tokens per cache block). dtype: cache dtype.

    Returns:
      The ``DEFAULT_TUNING`` entry, or for geometries outside the table (e.g.
      the small head dims of unit tests) ``TuningConfig()`` with ``block_kv``
      raised to at least S.

    Raises:
      NotImplementedError: head_dim is not a power of two >= 16 (Triton tiles
        must be powers of two), or dtype is neither bfloat16 nor float32.
    """
    name = jnp.dtype(dtype).name
    if name not in ("bfloat16", "float32"):
        raise NotImplementedError(f"dtype {name} is not supported (bfloat16, float32)")
    if not _is_pow2(head_dim) or head_dim < 16:
        raise NotImplementedError(f"head_dim must be a power of two >= 16, got {head_dim}")
    entry = DEFAULT_TUNING.get((head_dim, block_size, name))
    if entry is not None:
        return entry
    return TuningConfig(block_kv=max(64, 1 << (block_size - 1).bit_length()))


def num_kv_splits(tuning: TuningConfig, *, num_tokens: int, num_rows: int, num_kv_heads: int,
                  max_context: int) -> int:
    """KV splits (flash-decoding partitions) for one call; 1 means no split-K.

    Only decode-shaped steps split. At most ``min(T, R)`` rows can be live, so
    without splitting such a step runs about ``min(T, R) * K`` programs; the
    split count raises that to about two programs per H100 SM, capped by
    ``tuning.k_splits`` and by the number of KV tiles of the longest context
    the block table can address (``max_context`` tokens).
    """
    if num_tokens > tuning.decode_max_tokens or tuning.k_splits == 1:
        return 1
    programs = max(1, min(num_tokens, num_rows) * num_kv_heads)
    want = -(-2 * H100_NUM_SMS // programs)
    splits = 1
    while splits < want:
        splits *= 2
    max_tiles = max(1, -(-max_context // tuning.block_kv))
    return max(1, min(splits, tuning.k_splits, max_tiles))
