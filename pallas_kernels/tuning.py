"""Tunables of the Pallas ragged paged attention kernel and their default table.

A variant of the kernel is a ``TuningConfig`` (a static argument), never a
separate kernel: block sizes, Triton's ``num_warps`` / ``num_stages`` (each
with a decode-shaped counterpart: ``TuningConfig.launch`` picks the set a
step uses) and an optional split-K cap; ``num_kv_splits`` holds the split-K rule. ``DEFAULT_TUNING`` is keyed by
``(tile width, block_size, dtype name)``, the tile width being the head dim
padded to a power of two (``padded_head_dim``: 80 and 96 use the 128 entry); every entry is lowered for ``cuda`` in
the default test suite and compiled for an H100 in the ``h100`` tier
(scripts/h100_compile_env.sh), which is what caught shared-memory overflows
while the table was written (docs/kernels.md has the numbers).

Legend (docs/kernels.md): T tokens, R rows, N query heads, K KV heads,
G = N / K, H head dim, S block size.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import jax.numpy as jnp

# The H100 SXM's device facts, also the topology of the deviceless compile tier.
H100_TARGET_CONFIG = pathlib.Path(__file__).with_name("h100_target_config.pbtxt")
# Streaming multiprocessors of an H100 SXM: core_count in H100_TARGET_CONFIG (132).
H100_NUM_SMS = int(re.search(r"core_count: (\d+)", H100_TARGET_CONFIG.read_text()).group(1))
# Split-K aims for this many programs per SM: with one, an SM whose program
# finishes early idles until the slowest is done; with two, the hardware
# scheduler evens out uneven splits (a reasoned choice, not yet measured).
PROGRAMS_PER_SM = 2


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class Launch:
    """The tile sizes and Triton parameters of one kernel launch (one T bucket)."""

    block_m: int  # query rows of a program, before raising it to the padded GQA group
    block_kv: int  # keys per inner-loop iteration
    num_warps: int
    num_stages: int
    decode_shaped: bool  # T <= decode_max_tokens: the decode set, and split-K allowed


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
      decode_block_kv, decode_num_warps, decode_num_stages: ``block_kv``,
        ``num_warps`` and ``num_stages`` of decode-shaped steps; None (default)
        takes the prefill value. A decode tile holds few query rows, so its
        accumulator is small and shared memory left over from the q tile can
        hold deeper K/V pipelines or larger key tiles.
      k_splits: a cap on the KV splits (flash-decoding) of a decode-shaped
        step: 0 (default) leaves the count to ``num_kv_splits``'s rule alone,
        1 disables split-K.
      decode_max_tokens: steps of at most this many tokens count as
        decode-shaped (0: none).
    """

    block_m: int = 64
    decode_block_m: int = 16
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    k_splits: int = 0
    decode_max_tokens: int = 256
    decode_block_kv: int | None = None
    decode_num_warps: int | None = None
    decode_num_stages: int | None = None

    def __post_init__(self):
        for name in ("block_m", "decode_block_m", "block_kv", "decode_block_kv"):
            value = getattr(self, name)
            if value is not None and (not _is_pow2(value) or value < 16):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        for name in ("num_warps", "decode_num_warps"):
            value = getattr(self, name)
            if value is not None and value not in (1, 2, 4, 8, 16):
                raise ValueError(f"{name} must be a power of two <= 16, got {value}")
        for name in ("num_stages", "decode_num_stages"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("k_splits", "decode_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def launch(self, num_tokens: int) -> Launch:
        """The launch parameters of a step of ``num_tokens`` (T) tokens.

        Decode-shaped steps (T <= ``decode_max_tokens``) take ``decode_block_m``
        and the ``decode_*`` fields (each falling back to its prefill value);
        others take ``block_m``, ``block_kv``, ``num_warps``, ``num_stages``.
        """
        if num_tokens > self.decode_max_tokens:
            return Launch(self.block_m, self.block_kv, self.num_warps, self.num_stages, False)

        def pick(decode, prefill):
            return prefill if decode is None else decode

        return Launch(self.decode_block_m, pick(self.decode_block_kv, self.block_kv),
                      pick(self.decode_num_warps, self.num_warps),
                      pick(self.decode_num_stages, self.num_stages), True)


# Decode-shaped launches (reasoned, not yet timed on a GPU): a decode tile has
# decode_block_m = 16 query rows, so its q tile, accumulator and dot layout
# conversions are small and shared memory goes to the K/V pipeline. Each stage
# holds one key tile of K and V, sized to DECODE_STAGE_BYTES; the stages that fit
# DECODE_KV_SMEM_BYTES (at most 3) keep the gathers of the next tiles in flight.
# 96 KiB of K/V per program leaves room for two programs on one H100 SM
# (228 KiB of shared memory per SM), which the split rule aims for.
DECODE_STAGE_BYTES = 32 * 1024
DECODE_KV_SMEM_BYTES = 96 * 1024
DECODE_NUM_WARPS = 4


def decode_launch_fields(head_dim: int, block_size: int, itemsize: int) -> dict[str, int]:
    """``decode_block_kv`` / ``decode_num_stages`` / ``decode_num_warps`` of a table entry.

    block_kv = max(S, 16, pow2 floor of DECODE_STAGE_BYTES / (2 · H · itemsize)), so
    that one stage (a K and a V tile) is 32 KiB unless S forces more; stages =
    clamp(DECODE_KV_SMEM_BYTES // stage bytes, 1, 3). bfloat16 at H = 64 / 128 /
    256: 128 / 64 / 32 keys, 3 stages.
    """
    per_key = 2 * head_dim * itemsize  # bytes of K and V for one key
    block_kv = max(block_size, 16, 1 << (max(1, DECODE_STAGE_BYTES // per_key).bit_length() - 1))
    stages = min(3, max(1, DECODE_KV_SMEM_BYTES // (block_kv * per_key)))
    return dict(decode_block_kv=block_kv, decode_num_stages=stages,
                decode_num_warps=DECODE_NUM_WARPS)


def _entries() -> dict[tuple[int, int, str], TuningConfig]:
    """The default table, one entry per (head_dim, block_size, dtype name).

    Prefill-shaped launches: bfloat16 keeps K/V tiles of 64 keys x H in two
    pipeline stages (64 KiB of shared memory at H = 256); float32 tiles are
    twice as wide per key, so they halve block_kv (and block_m at H = 256) to
    stay within the H100's 227 KiB of shared memory per block with room for
    the q tile and the layout conversions of ``dot``. The KV tile never goes
    below one cache block, so that one block-table entry serves whole rows of
    the tile. Decode-shaped launches follow ``decode_launch_fields``.
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
                cfg = dataclasses.replace(
                    cfg, block_kv=max(cfg.block_kv, block_size),
                    **decode_launch_fields(head_dim, block_size, jnp.dtype(dtype).itemsize))
                table[(head_dim, block_size, dtype)] = cfg
    return table


DEFAULT_TUNING: dict[tuple[int, int, str], TuningConfig] = _entries()


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, x - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """H_pad: the kernel's tile width for head dim H, the next power of two, at least 16.

    Triton tiles are powers of two and ``tl.dot`` needs a reduction dimension of
    at least 16; the kernel masks the columns from H to H_pad (80 and 96 run as
    128, 48 as 64). ``DEFAULT_TUNING`` is keyed by this width.

    Raises:
      ValueError: head_dim < 1.
    """
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    return max(16, next_pow2(head_dim))


def tuning_for(head_dim: int, block_size: int, dtype) -> TuningConfig:
    """The default tuning for one cache geometry.

    Args:
      head_dim: H, any width >= 1; the table is looked up at ``padded_head_dim(H)``
        (H = 80 and 96 take the H = 128 entry).
      block_size: S (tokens per cache block). dtype: cache dtype.

    Returns:
      The ``DEFAULT_TUNING`` entry, or for geometries outside the table (e.g.
      the small head dims of unit tests) ``TuningConfig()`` with ``block_kv``
      raised to at least S.

    Raises:
      NotImplementedError: dtype is neither bfloat16 nor float32.
      ValueError: head_dim < 1.
    """
    name = jnp.dtype(dtype).name
    if name not in ("bfloat16", "float32"):
        raise NotImplementedError(f"dtype {name} is not supported (bfloat16, float32)")
    entry = DEFAULT_TUNING.get((padded_head_dim(head_dim), block_size, name))
    if entry is not None:
        return entry
    return TuningConfig(block_kv=max(64, 1 << (block_size - 1).bit_length()))


def num_kv_splits(tuning: TuningConfig, *, num_tokens: int, num_rows: int, num_kv_heads: int,
                  max_context: int, num_sms: int = H100_NUM_SMS) -> int:
    """KV splits NS (flash-decoding partitions) of one call; 1 means no split-K.

    NS is a static shape (the partials' leading axis), so it is chosen from
    static quantities only: the T bucket, R, K, the longest context the block
    table can address (``max_context = MB * S`` tokens, from max_model_len)
    and the SM count. Rule, for decode-shaped steps (``T <= decode_max_tokens``):

        live programs without split-K  P1 = min(T, R) * K
        NS = min(ceil(PROGRAMS_PER_SM * num_sms / P1), ceil(max_context / block_kv))

    and NS = 1 for prefill-shaped steps (block_kv is the decode launch's,
    ``TuningConfig.launch``). At most min(T, R) rows can have
    tokens (the tile schedule gives rows with none no tile), so P1 is the
    most programs a split-free step can keep busy; NS multiplies them to about
    two per SM. The second term keeps every split at least one key tile at
    full context (shorter rows leave some of their splits empty: such a
    program stores an empty partial and exits). A nonzero ``tuning.k_splits``
    caps NS. Examples on 132 SMs: Llama-3-8B (K = 8) batch-1 decode (T = 1)
    at 8k context: NS = 33, 264 programs; 16 rows: NS = 3; 256 rows: NS = 1.

    Args:
      tuning: the kernel variant (``decode_max_tokens``, ``block_kv``, ``k_splits``).
      num_tokens: T. num_rows: R. num_kv_heads: K.
      max_context: tokens one block-table row addresses (MB * S).
      num_sms: SMs of the target GPU (default: the H100 SXM's 132).
    """
    launch = tuning.launch(num_tokens)
    if not launch.decode_shaped or tuning.k_splits == 1:
        return 1
    programs = max(1, min(num_tokens, num_rows) * num_kv_heads)
    splits = -(-PROGRAMS_PER_SM * num_sms // programs)
    splits = min(splits, max(1, -(-max_context // launch.block_kv)))
    if tuning.k_splits:
        splits = min(splits, tuning.k_splits)
    return max(1, splits)
