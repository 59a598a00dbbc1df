"""The Pallas kernel in interpret mode against the float64 oracle (and the reference).

Every case (tests/pallas_kernels/attention_cases.py) mixes empty rows, decode
rows, a row of exactly one block, a row ending on a block boundary, a prefill
continuing after 3 cached blocks, padding rows and padding tokens; unused cache
slots are NaN and the block table is a random permutation padded with
out-of-range ids. Each case runs two variants of the kernel: the split-K path
(decode-shaped tiles, KV split in several programs, combine step) and the
single-pass path (prefill-shaped tiles, one program per tile and KV head).

Bounds on ‖out − oracle‖ / ‖oracle‖: float32 1e-5 (accumulation order; the
kernel measures ~2e-7); bfloat16 1e-2 (the oracle sees the same rounded
inputs; the kernel rounds the probabilities to bfloat16 before P·V, as
FlashAttention does, and the output to bfloat16: 2^-9 relative per element,
measured ~2e-3 in norm).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)
from pallas_kernels.rpa_kernel import next_pow2
from pallas_kernels.tuning import TuningConfig, num_kv_splits, padded_head_dim, tuning_for
from tests.pallas_kernels.attention_cases import (device_args, make_case, oracle, relative_error,
                                                  round_to)

BOUND = {"float32": 1e-5, "bfloat16": 1e-2}

# dtype x block size x (N, K) at head_dim 64, then the larger head dims.
SWEEP = [(dt, s, nk, 64) for dt in ("float32", "bfloat16") for s in (16, 32, 64)
         for nk in ((4, 4), (9, 3), (8, 2))]
SWEEP += [(dt, 16, (6, 2), h) for dt in ("float32", "bfloat16") for h in (128, 256)]


def variants(head_dim: int, block_size: int, dtype: str, case) -> dict[str, TuningConfig]:
    """The split-K (decode launch) and single-pass (prefill launch) variants of the default tuning.

    The split variant keeps the default decode key tile when the case's context
    spans two of them, else takes the smallest tile so that the case still splits.
    """
    base = tuning_for(head_dim, block_size, dtype)
    split = dataclasses.replace(base, decode_max_tokens=max(base.decode_max_tokens, len(case.q)))
    splits = num_kv_splits(split, num_tokens=len(case.q), num_rows=len(case.seq_lens),
                           num_kv_heads=case.k_cache.shape[1],
                           max_context=case.block_table.shape[1] * block_size)
    if splits == 1:
        split = dataclasses.replace(split, decode_block_kv=max(16, block_size))
    single = dataclasses.replace(base, decode_max_tokens=0, k_splits=1)
    return {"split": split, "single": single}


def run(case, dtype, tuning, **kw):
    out = ragged_paged_attention(*device_args(case, dtype), interpret=True, tuning=tuning, **kw)
    return np.asarray(out.astype(jnp.float32))


def check(out, case, dtype, **kw):
    ref = oracle(case, **kw)
    assert np.isfinite(out).all()
    err = relative_error(out, ref)
    assert err < BOUND[dtype], err
    assert (out[case.query_start_loc[-1]:] == 0).all(), "padding tokens must give zeros"
    return err


@pytest.mark.parametrize("dtype,block_size,heads,head_dim", SWEEP,
                         ids=[f"{d}-S{s}-{n}x{k}-H{h}" for d, s, (n, k), h in SWEEP])
def test_kernel_matches_oracle(dtype, block_size, heads, head_dim):
    rng = np.random.default_rng(1000 * block_size + 10 * heads[0] + head_dim)
    case = make_case(rng, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                     block_size=block_size)
    case = round_to(case, dtype)
    scale = head_dim ** -0.5
    for name, tuning in variants(head_dim, block_size, dtype, case).items():
        splits = num_kv_splits(tuning, num_tokens=len(case.q), num_rows=len(case.seq_lens),
                               num_kv_heads=heads[1],
                               max_context=case.block_table.shape[1] * block_size)
        assert (splits > 1) == (name == "split"), (name, splits)
        check(run(case, dtype, tuning, sm_scale=scale), case, dtype, sm_scale=scale)


@pytest.mark.parametrize("window,cap", [(8, None), (None, 5.0), (20, 2.0)])
def test_sliding_window_and_soft_cap(window, cap):
    rng = np.random.default_rng(7)
    case = make_case(rng, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16)
    scale = 64 ** -0.5
    for tuning in variants(64, 16, "float32", case).values():
        out = run(case, "float32", tuning, sm_scale=scale, sliding_window=window, soft_cap=cap)
        check(out, case, "float32", sm_scale=scale, sliding_window=window, soft_cap=cap)


def test_long_context_decode_split_k():
    """Long decode rows and a chunk straddling two query tiles, over many splits.

    The case flash-decoding exists for, with the uncapped split rule: 9 rows x
    2 KV heads give 18 programs without split-K, so NS = ceil(264 / 18) = 15
    (more than the old fixed cap of 8); the 701-key row spreads 22 key tiles
    over 15 splits (1 or 2 each), the short rows leave most splits empty, and
    the 6-token chunk (decode tiles hold 4 tokens at G = 4) spans two tiles.
    """
    rng = np.random.default_rng(11)
    rows = [(1, 700), (1, 33), (0, 0), (1, 257), (1, 0), (6, 300)]
    case = make_case(rng, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, rows=rows,
                     pad_tokens=4, pad_rows=3)
    tuning = TuningConfig(block_kv=32)
    splits = num_kv_splits(tuning, num_tokens=len(case.q), num_rows=len(case.seq_lens),
                           num_kv_heads=2, max_context=case.block_table.shape[1] * 16)
    assert splits == 15
    check(run(case, "float32", tuning, sm_scale=0.125), case, "float32", sm_scale=0.125)


def test_matches_reference_bf16():
    """Kernel and jnp reference agree in bfloat16 to within their joint rounding."""
    rng = np.random.default_rng(3)
    case = round_to(make_case(rng, num_heads=9, num_kv_heads=3, head_dim=64, block_size=32),
                    "bfloat16")
    args = device_args(case, jnp.bfloat16)
    ref = ragged_paged_attention_reference(*args, sm_scale=0.125).astype(jnp.float32)
    out = ragged_paged_attention(*args, sm_scale=0.125, interpret=True).astype(jnp.float32)
    assert relative_error(np.asarray(out), np.asarray(ref, np.float64)) < 1e-2


def test_group_padding_keeps_heads_apart():
    """N / K = 5 pads the group to 8 lanes; each head must still see only its own query."""
    rng = np.random.default_rng(5)
    case = make_case(rng, num_heads=10, num_kv_heads=2, head_dim=64, block_size=16)
    assert next_pow2(5) == 8
    case.q[:, 4] *= 30.0  # one loud head: a lane mix-up would leak it into its neighbours
    tuning = variants(64, 16, "float32", case)["single"]
    check(run(case, "float32", tuning, sm_scale=0.125), case, "float32", sm_scale=0.125)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dim_not_a_power_of_two(head_dim, dtype):
    """H = 80 / 96 (Phi-2's heads are 80 wide) runs in tiles of 128 columns.

    The padding columns (80 or 96 to 128) are masked on load and store: the
    output must match the oracle with no column leaking from the next head's
    row, through both the split-K and the single-pass paths.
    """
    assert padded_head_dim(head_dim) == 128
    rng = np.random.default_rng(head_dim)
    case = make_case(rng, num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=16)
    case.q[:, 1] *= 30.0  # one loud head: a column leak would show in its neighbours
    case = round_to(case, dtype)
    scale = head_dim ** -0.5
    assert tuning_for(head_dim, 16, dtype) == tuning_for(128, 16, dtype)
    for tuning in variants(head_dim, 16, dtype, case).values():
        out = run(case, dtype, tuning, sm_scale=scale)
        assert out.shape[-1] == head_dim
        check(out, case, dtype, sm_scale=scale)


def test_bad_inputs_raise():
    q = jnp.ones((4, 4, 64), jnp.float32)
    cache = jnp.ones((3, 2, 16, 64), jnp.bfloat16)
    meta = (jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="dtype"):
        ragged_paged_attention(q, cache, cache, *meta, sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="multiple"):
        ragged_paged_attention(q[:, :3], cache.astype(q.dtype), cache.astype(q.dtype), *meta,
                               sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        ragged_paged_attention(q[..., :48], cache.astype(q.dtype), cache.astype(q.dtype), *meta,
                               sm_scale=1.0, interpret=True)
    with pytest.raises(NotImplementedError, match="float16"):
        half = cache.astype(jnp.float16)
        ragged_paged_attention(q.astype(jnp.float16), half, half, *meta, sm_scale=1.0,
                               interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        TuningConfig(block_kv=24)


FP8_SWEEP = [("float32", 16, (9, 3), 64), ("bfloat16", 16, (8, 2), 128),
             ("bfloat16", 32, (4, 4), 64)]


@pytest.mark.parametrize("dtype,block_size,heads,head_dim", FP8_SWEEP,
                         ids=[f"{d}-S{s}-{n}x{k}-H{h}" for d, s, (n, k), h in FP8_SWEEP])
def test_fp8_cache_matches_oracle(dtype, block_size, heads, head_dim):
    """An fp8 (e4m3) cache, widened to q's dtype tile by tile, against the float64 oracle.

    The oracle sees the e4m3-rounded keys and values (every e4m3 value is exact in
    bfloat16 and float32), so the bounds are q's dtype's, as for an unquantized
    cache; both kernel paths and the jnp reference are held to them. The unowned
    slots stay NaN in e4m3 (a masked read must still drop them).
    """
    rng = np.random.default_rng(2000 + head_dim + block_size)
    case = make_case(rng, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                     block_size=block_size)
    case = dataclasses.replace(round_to(case, "float8_e4m3fn"), q=round_to(case, dtype).q)
    assert np.isnan(case.k_cache).any()
    scale = head_dim ** -0.5
    q, k, v, *meta = device_args(case, dtype)
    fp8 = (k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn))
    assert np.array_equal(np.asarray(fp8[0], np.float32), case.k_cache, equal_nan=True)
    for tuning in variants(head_dim, block_size, dtype, case).values():
        out = ragged_paged_attention(q, *fp8, *meta, sm_scale=scale, interpret=True,
                                     tuning=tuning)
        check(np.asarray(out.astype(jnp.float32)), case, dtype, sm_scale=scale)
    ref = ragged_paged_attention_reference(q, *fp8, *meta, sm_scale=scale)
    check(np.asarray(ref.astype(jnp.float32)), case, dtype, sm_scale=scale)
