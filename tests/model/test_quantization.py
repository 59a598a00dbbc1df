"""Weight-only int8 quantization (``jaxserve.model.quantization``): the round trip's error
bound, the embedding lookup, the parameter-tree rewrite and the method check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model import quantization


def test_round_trip_error_is_at_most_half_a_step_per_row():
    rng = np.random.default_rng(0)
    # rows of very different magnitudes, one all-zero row, a [L, out, in] stack
    w = rng.standard_normal((3, 40, 33)).astype(np.float32) * rng.uniform(1e-3, 10, (3, 40, 1))
    w[1, 7] = 0.0
    q, scale = quantization.quantize(jnp.asarray(w))
    assert q.dtype == jnp.int8 and q.shape == w.shape
    assert scale.dtype == jnp.float32 and scale.shape == (3, 40)
    np.testing.assert_allclose(scale, np.where(np.abs(w).max(-1) > 0, np.abs(w).max(-1) / 127, 1),
                               rtol=1e-6)
    assert int(jnp.abs(q.astype(jnp.int32)).max()) == 127  # each nonzero row uses the full range
    back = np.asarray(quantization.dequantize(q, scale))
    # round to nearest: |w - q·s| <= s/2 (plus float32 rounding of the division)
    err = np.abs(back - w)
    assert (err <= np.asarray(scale)[..., None] * (0.5 + 1e-5)).all(), err.max()
    np.testing.assert_array_equal(back[1, 7], 0.0)


def test_embed_lookup_is_the_dequantized_rows():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((50, 16)).astype(np.float32)
    q, scale = quantization.quantize(jnp.asarray(table))
    ids = jnp.asarray([3, 0, 49, 3], jnp.int32)
    out = quantization.embed_lookup(q, scale, ids, jnp.float32)
    np.testing.assert_array_equal(out, quantization.dequantize(q, scale)[ids])


def test_quantize_params_rewrites_the_linear_kernels_only():
    params = {"embed": jnp.ones((8, 4)), "norm": {"weight": jnp.ones(4)},
              "layers": {0: {"attn": {"qkv_proj": jnp.ones((6, 4)), "qkv_bias": jnp.ones(6)}}}}
    out = quantization.quantize_params(params, "int8")
    assert out["embed"].dtype == jnp.int8 and out["embed_scale"].shape == (8,)
    assert out["norm"]["weight"].dtype == jnp.float32
    attn = out["layers"][0]["attn"]
    assert attn["qkv_proj"].dtype == jnp.int8 and attn["qkv_proj_scale"].shape == (6,)
    assert attn["qkv_bias"].dtype == jnp.float32
    assert quantization.quantize_params(params, None) is params


@pytest.mark.parametrize("bad", ["fp8", "INT8", "awq", ""])
def test_unsupported_method_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match=r"quantization must be one of None, 'int8'") as err:
        quantization.check_method(bad)
    assert "\n" not in str(err.value) and repr(bad) in str(err.value)
