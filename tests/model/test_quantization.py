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
    with pytest.raises(ValueError, match=r"quantization must be one of None, 'int8', 'int4'") as err:
        quantization.check_method(bad)
    assert "\n" not in str(err.value) and repr(bad) in str(err.value)


@pytest.mark.parametrize("group", [32, 64])
def test_int4_round_trip_error_is_at_most_half_a_step_per_group(group):
    rng = np.random.default_rng(2)
    # groups of very different magnitudes, one all-zero group, a [L, out, in] stack
    w = rng.standard_normal((2, 24, 192)).astype(np.float32)
    w *= np.repeat(rng.uniform(1e-3, 10, (2, 24, 192 // group)), group, axis=-1)
    w[1, 5, group:2 * group] = 0.0
    packed, scale = quantization.quantize(jnp.asarray(w), "int4", group)
    assert packed.dtype == jnp.uint8 and packed.shape == (2, 24, 96)
    assert scale.dtype == jnp.float32 and scale.shape == (2, 24, 192 // group)
    absmax = np.abs(w.reshape(2, 24, -1, group)).max(-1)
    np.testing.assert_allclose(scale, np.where(absmax > 0, absmax / 7.5, 1), rtol=1e-6)
    values = np.asarray(quantization.unpack_int4(packed)).astype(np.int64)
    assert values.min() == -8 and values.max() == 7  # the 16 levels are all used
    back = np.asarray(quantization.dequantize(packed, scale))
    step = np.repeat(np.asarray(scale), group, axis=-1)
    # the oracle: the layout's definition applied to the unpacked values, in float64
    np.testing.assert_allclose(back, values * step, rtol=1e-6)
    # round to nearest within [-7.5, 7.5] steps: |w - q·s| <= s/2 (plus float32 rounding)
    err = np.abs(back - w)
    assert (err <= step * (0.5 + 1e-5)).all(), (err / step).max()
    np.testing.assert_array_equal(back[1, 5, group:2 * group], 0.0)


def test_int4_packing_is_q4_0s_nibble_order():
    """Byte j of a 32-input run: input j in the low nibble, input j + 16 in the high one,
    each stored as value + 8 (llama.cpp's Q4_0 order)."""
    q = np.tile(np.arange(-8, 8), 4).reshape(1, 64)  # inputs 0..15 and 16..31 of each run
    w = jnp.asarray(q, jnp.float32) * (7.5 / 8)  # absmax 7.5: scale 1; q·15/16 rounds to q
    packed, scale = quantization.quantize(w, "int4")
    np.testing.assert_array_equal(scale, 1.0)
    want = [(q[0, 32 * r + j] + 8) | ((q[0, 32 * r + 16 + j] + 8) << 4)
            for r in range(2) for j in range(16)]
    np.testing.assert_array_equal(np.asarray(packed)[0], want)


def test_int4_embed_lookup_is_the_dequantized_rows():
    rng = np.random.default_rng(4)
    packed, scale = quantization.quantize(jnp.asarray(rng.standard_normal((50, 64)),
                                                      jnp.float32), "int4")
    ids = jnp.asarray([3, 0, 49, 3], jnp.int32)
    out = quantization.embed_lookup(packed, scale, ids, jnp.float32)
    np.testing.assert_array_equal(out, quantization.dequantize(packed, scale)[ids])


@pytest.mark.parametrize("shape,group,match", [((4, 48), 32, "size 32; a kernel's input dimension is 48"),
                                               ((4, 64), 16, "power of two >= 32"),
                                               ((4, 96), 48, "power of two >= 32")])
def test_int4_refuses_a_bad_input_dimension_or_group(shape, group, match):
    with pytest.raises(ValueError, match=match) as err:
        quantization.quantize(jnp.ones(shape), "int4", group)
    assert "\n" not in str(err.value)


def test_params_method_reads_the_kernels_dtype():
    params = {"embed": jnp.ones((8, 64)), "norm": jnp.ones(64)}
    assert quantization.params_method(params) is None
    for method in ("int8", "int4"):
        assert quantization.params_method(quantization.quantize_params(params, method)) == method
