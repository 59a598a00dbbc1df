"""The pure-jnp reference (the CPU backend) against a float64 NumPy oracle.

Bounds on ‖out − oracle‖ / ‖oracle‖: 1e-5 in float32 (accumulation order),
1e-2 in bfloat16 (inputs and output rounded to 8 mantissa bits, 2^-8 ≈ 4e-3
per element; the norm of the error stays below 1e-2).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.pallas_kernels.attention_cases import make_case, oracle, relative_error

BOUND = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _run(case, dtype, **kw):
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    out = ragged_paged_attention_reference(
        cast(case.q), cast(case.k_cache), cast(case.v_cache), jnp.asarray(case.block_table),
        jnp.asarray(case.seq_lens), jnp.asarray(case.query_start_loc), **kw)
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("query_chunk", [8, 64])
def test_reference_matches_oracle(dtype, block_size, heads, query_chunk):
    """query_chunk 8 puts rows across chunk boundaries and gives single-row
    (shared-tile) chunks inside the long prefills; 64 mixes rows in a chunk."""
    rng = np.random.default_rng(block_size * 100 + heads[0])
    case = make_case(rng, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64,
                     block_size=block_size)
    if dtype == jnp.bfloat16:  # the oracle sees the same rounded inputs
        for name in ("q", "k_cache", "v_cache"):
            setattr(case, name, np.asarray(jnp.asarray(getattr(case, name), dtype), np.float32))
    scale = 64 ** -0.5
    out = _run(case, dtype, sm_scale=scale, context_tile=32, query_chunk=query_chunk)
    ref = oracle(case, sm_scale=scale)
    assert np.isfinite(out).all()
    assert relative_error(out, ref) < BOUND[dtype]
    pad_start = case.query_start_loc[-1]
    assert (out[pad_start:] == 0).all(), "padding tokens must give zeros"


@pytest.mark.parametrize("window,cap", [(8, None), (None, 5.0), (20, 2.0)])
@pytest.mark.parametrize("query_chunk", [4, 64])
def test_sliding_window_and_soft_cap(window, cap, query_chunk):
    rng = np.random.default_rng(5)
    case = make_case(rng, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
    scale = 32 ** -0.5
    out = _run(case, jnp.float32, sm_scale=scale, sliding_window=window, soft_cap=cap,
               query_chunk=query_chunk)
    ref = oracle(case, sm_scale=scale, sliding_window=window, soft_cap=cap)
    assert relative_error(out, ref) < BOUND[jnp.float32]


def test_bad_shapes_raise():
    q = jnp.zeros((4, 6, 32))
    cache = jnp.zeros((3, 4, 16, 32))  # 6 heads over 4 KV heads
    with pytest.raises(ValueError, match="multiple"):
        ragged_paged_attention_reference(q, cache, cache, jnp.zeros((2, 2), jnp.int32),
                                         jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32),
                                         sm_scale=1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        ragged_paged_attention_reference(q, cache[:, :2], cache[:, :2], jnp.zeros((2, 2), jnp.int32),
                                         jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32),
                                         sm_scale=1.0)
