"""Quantization (``jaxserve.model.quantization``): the int8 and fp8 round trips' error
bound, the embedding lookup, the parameter-tree rewrite and the method check; int4 taken
from llama.cpp Q4_1 blocks against the gguf package's dequantization."""

import jax
import jax.numpy as jnp
import ml_dtypes
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


@pytest.mark.parametrize("bad", ["FP8", "INT8", "awq", ""])
def test_unsupported_method_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match=r"quantization must be one of None, 'int8', 'int4', 'fp8'") as err:
        quantization.check_method(bad)
    assert "\n" not in str(err.value) and repr(bad) in str(err.value)


@pytest.mark.parametrize("group", [32, 64])
def test_int4_round_trip_error_is_at_most_half_a_step_per_group(group):
    rng = np.random.default_rng(2)
    # groups of very different magnitudes and offsets, one constant group, a [L, out, in] stack
    w = rng.standard_normal((2, 24, 192)).astype(np.float32)
    w *= np.repeat(rng.uniform(1e-3, 10, (2, 24, 192 // group)), group, axis=-1)
    w += np.repeat(rng.uniform(-5, 5, (2, 24, 192 // group)), group, axis=-1)
    w[1, 5, group:2 * group] = 0.25
    packed, scale = quantization.quantize(jnp.asarray(w), "int4", group)
    assert packed.dtype == jnp.uint8 and packed.shape == (2, 24, 96)
    assert scale.dtype == jnp.float32 and scale.shape == (2, 24, 192 // group, 2)
    groups = w.reshape(2, 24, -1, group)
    spread = groups.max(-1) - groups.min(-1)
    np.testing.assert_allclose(scale[..., 0], np.where(spread > 0, spread / 15, 1), rtol=1e-5)
    np.testing.assert_array_equal(scale[..., 1], groups.min(-1))
    values = np.asarray(quantization.unpack_int4(packed)).astype(np.int64)
    assert values.min() == 0 and values.max() == 15  # both ends of a group on the grid
    back = np.asarray(quantization.dequantize(packed, scale))
    step, offset = (np.repeat(np.asarray(scale[..., i]), group, axis=-1) for i in (0, 1))
    # the oracle: the layout's definition applied to the unpacked values, in float64
    np.testing.assert_allclose(back, values * step.astype(np.float64) + offset, rtol=1e-5,
                               atol=1e-6 * np.abs(offset).max())
    # round to nearest: |w - (q·d + m)| <= d/2 (plus float32 rounding of the offset's size)
    err = np.abs(back - w)
    assert (err <= step * (0.5 + 1e-4) + 1e-6 * np.abs(w)).all(), (err / step).max()
    np.testing.assert_array_equal(back[1, 5, group:2 * group], 0.25)  # constant: exact


def test_int4_packing_is_llama_cpps_nibble_order():
    """Byte j of a 32-input run: input j in the low nibble, input j + 16 in the high one
    (llama.cpp's Q4_0 / Q4_1 order)."""
    q = np.tile(np.arange(16), 4).reshape(1, 64)  # each group spans 0..15: step 1, offset 0
    packed, scale = quantization.quantize(jnp.asarray(q, jnp.float32), "int4")
    np.testing.assert_array_equal(scale, [[[1.0, 0.0], [1.0, 0.0]]])
    want = [q[0, 32 * r + j] | (q[0, 32 * r + 16 + j] << 4) for r in range(2) for j in range(16)]
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
    params = {"embed": jnp.ones((8, 64)), "o_proj": jnp.ones((64, 64)), "norm": jnp.ones(64)}
    assert quantization.params_method(params) is None
    for method in ("int8", "int4"):
        assert quantization.params_method(quantization.quantize_params(params, method)) == method


def test_int4_keeps_the_embedding_and_lm_head_at_int8():
    params = {"embed": jnp.ones((8, 64)), "lm_head": jnp.ones((8, 64)),
              "layers": {0: {"mlp": {"down_proj": jnp.ones((4, 64))}}}}
    out = quantization.quantize_params(params, "int4")
    assert out["embed"].dtype == out["lm_head"].dtype == jnp.int8
    assert out["layers"][0]["mlp"]["down_proj"].dtype == jnp.uint8
    assert out["layers"][0]["mlp"]["down_proj_scale"].shape == (4, 2, 2)


def test_int4_from_q4_1_is_bit_equal_to_ggufs_dequantization():
    """Q4_1 blocks written by the gguf package (random rows of mixed magnitudes, a [L, out, in]
    stack) → our int4: ``dequantize`` gives ``gguf.quants.dequantize``'s float32 values bit for
    bit, the scale is the blocks' float16 (d, m), and the bytes are the blocks' nibbles."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(7)
    w = rng.standard_normal((2, 24, 96)).astype(np.float32) * rng.uniform(1e-3, 5, (2, 24, 1))
    blocks = quantize(w, T.Q4_1)  # u8[2, 24, 3 · 20]
    assert blocks.shape == (2, 24, 3 * quantization.Q4_1_BLOCK_BYTES)
    packed, scale = quantization.int4_from_q4_1(jnp.asarray(blocks))
    assert packed.dtype == jnp.uint8 and packed.shape == (2, 24, 48)
    assert scale.dtype == jnp.float32 and scale.shape == (2, 24, 3, 2)
    got = np.asarray(quantization.dequantize(packed, scale))
    assert got.dtype == np.float32
    assert np.array_equal(got, dequantize(blocks, T.Q4_1))
    structs = blocks.reshape(2, 24, 3, 20)
    np.testing.assert_array_equal(scale, structs[..., :4].copy().view(np.float16).astype(np.float32))
    np.testing.assert_array_equal(packed, structs[..., 4:].reshape(2, 24, 48))


@pytest.mark.parametrize("blocks", [np.zeros((4, 30), np.uint8), np.zeros((4, 40), np.int8)],
                         ids=["partial-block", "int8"])
def test_int4_from_q4_1_refuses_what_is_not_whole_q4_1_blocks(blocks):
    with pytest.raises(ValueError, match="Q4_1 rows must be uint8 whole 20-byte blocks"):
        quantization.int4_from_q4_1(jnp.asarray(blocks))


# fp8 (e4m3) numerics, on any platform: XLA widens fp8 dot operands on the CPU, exactly.

def _e4m3_round(x: np.ndarray) -> np.ndarray:
    """float32 → the nearest e4m3 value as float64 (ml_dtypes' cast: round to nearest even)."""
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def test_fp8_round_trip_error_is_within_e4m3s_half_ulp():
    rng = np.random.default_rng(5)
    # rows of very different magnitudes, heavy tails (subnormal ratios), a zero row, an [L] stack
    w = rng.standard_t(2, (3, 40, 96)).astype(np.float32) * rng.uniform(1e-3, 10, (3, 40, 1))
    w[2, 3] = 0.0
    q, scale = quantization.quantize(jnp.asarray(w), "fp8")
    assert q.dtype == jnp.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == jnp.float32 and scale.shape == (3, 40)
    absmax = np.abs(w).max(-1)
    np.testing.assert_allclose(scale, np.where(absmax > 0, absmax / 448, 1), rtol=1e-6)
    qf = np.asarray(q.astype(jnp.float32))
    assert np.isfinite(qf).all()
    np.testing.assert_array_equal(np.abs(qf).max(-1)[absmax > 0], 448.0)  # full range used
    back = np.asarray(quantization.dequantize(q, scale), np.float64)
    # 3 mantissa bits: half an ulp is 2^-4 of a normal value (|w / s| >= 2^-6), subnormals
    # are 2^-9 apart (half: 2^-10 · s); plus float32 rounding of the division
    s = np.asarray(scale, np.float64)[..., None]
    bound = np.maximum(np.abs(w) * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-5)
    err = np.abs(back - w)
    assert (err <= bound).all(), (err / bound).max()
    assert (err > 0).any()  # not vacuous
    np.testing.assert_array_equal(back[2, 3], 0.0)
    # the values are e4m3's rounding of w / s (ml_dtypes' cast, an independent reference)
    ratio = w / np.asarray(scale)[..., None]
    np.testing.assert_array_equal(qf, _e4m3_round(np.clip(ratio, -448, 448)))


def _fp8_linear_oracle(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """W8A8 in NumPy: each row of x quantized to e4m3 (scale max|x| / 448, the ratio taken in
    float32 as the model does, rounded by ml_dtypes), then the product and both rescales in
    float64."""
    x = x.astype(np.float32)
    absmax = np.abs(x).max(-1)
    x_scale = np.where(absmax > 0, absmax / np.float32(448), np.float32(1)).astype(np.float32)
    xq = _e4m3_round(np.clip(x / x_scale[:, None], -448, 448))
    out = xq @ q.astype(np.float64).T
    return out * x_scale.astype(np.float64)[:, None] * scale.astype(np.float64)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fp8_linear_is_the_quantize_then_multiply_oracle(rows):
    from jaxserve.model.llama import linear

    rng = np.random.default_rng(rows)
    w = rng.standard_normal((48, 160)).astype(np.float32) * rng.uniform(0.01, 2, (48, 1))
    x = rng.standard_normal((rows, 160)).astype(np.float32) * rng.uniform(0.1, 30, (rows, 1))
    x[rows // 2, 3] = 50.0 * np.abs(x).max()  # an outlier sets its row's scale
    q, scale = quantization.quantize(jnp.asarray(w), "fp8")
    q64 = np.asarray(q.astype(jnp.float32), np.float64)
    want = _fp8_linear_oracle(x, q64, np.asarray(scale))
    got = np.asarray(jax.jit(linear)(jnp.asarray(x), q, scale))
    assert got.dtype == np.float32
    # the products of e4m3 values are exact in float32; the sums and rescales round
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # and the W8A8 error against the float product, per output, from both operands' bounds
    x_err = np.maximum(np.abs(x) * 2.0 ** -4,
                       np.abs(x).max(-1, keepdims=True) / 448 * 2.0 ** -10)
    w_err = np.maximum(np.abs(w) * 2.0 ** -4, np.asarray(scale)[:, None] * 2.0 ** -10)
    bound = np.abs(x) @ w_err.T + x_err @ np.abs(w).T + x_err @ w_err.T
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    assert (np.abs(got - exact) <= bound * (1 + 1e-4) + 1e-6 * np.abs(exact).max()).all()
    # bfloat16 activations (the GPU dtype): the dot's output and the rescale round to bf16
    got16 = np.asarray(jax.jit(linear)(jnp.asarray(x, jnp.bfloat16), q, scale), np.float64)
    want16 = _fp8_linear_oracle(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), q64,
                                np.asarray(scale))
    np.testing.assert_allclose(got16, want16, rtol=2 * 2.0 ** -8,
                               atol=1e-3 * np.abs(want16).max())


# The demo model's (SmolLM2-135M) fp8 products, [in, out]: qkv_proj, o_proj, gate_up_proj,
# down_proj; at the row count of benchmarks.quantization's text (181 tokens).
@pytest.mark.parametrize("in_dim,out_dim", [(576, 960), (576, 576), (576, 3072), (1536, 576)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_fp8_dot_is_exact_at_the_demo_models_shapes(in_dim, out_dim):
    """The CPU's fp8 dot (XLA widens both e4m3 operands to float32; the products are exact
    there, 4 + 4 significant bits) against float64 sums of the same e4m3 values. Each row's
    absmax is 448 · 2^k, so its scale is 2^k whether it is computed as absmax / 448 or absmax ·
    (1 / 448) (XLA may rewrite the division): the e4m3 values of x are unambiguous and the
    oracle shares nothing with the code under test but the weights' e4m3 values. A dot that
    rounded its operands or its sums to 16 bits would miss by ~1e-3 of the output's scale;
    float32 sums of 1536 terms stay well within 1e-5."""
    from jaxserve.model.llama import linear

    rows = 181
    rng = np.random.default_rng(in_dim + out_dim)
    w = rng.standard_normal((out_dim, in_dim)).astype(np.float32) * rng.uniform(0.01, 0.2,
                                                                                 (out_dim, 1))
    k = rng.integers(-6, 4, rows)
    x = (rng.standard_normal((rows, in_dim)) * 60).clip(-440, 440).astype(np.float32)
    x[np.arange(rows), rng.integers(0, in_dim, rows)] = 448 * rng.choice([-1, 1], rows)
    x *= np.exp2(k)[:, None].astype(np.float32)
    q, scale = quantization.quantize(jnp.asarray(w), "fp8")
    xq = _e4m3_round(x * np.exp2(-k)[:, None].astype(np.float32))  # the ratio is exact
    want = (xq @ np.asarray(q.astype(jnp.float32), np.float64).T
            * np.exp2(k)[:, None] * np.asarray(scale, np.float64))
    got = np.asarray(jax.jit(linear)(jnp.asarray(x), q, scale), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_fp8_quantizes_the_decoder_kernels_only():
    params = {"embed": jnp.ones((8, 4)), "lm_head": jnp.ones((8, 4)), "norm": {"weight": jnp.ones(4)},
              "layers": {0: {"attn": {"qkv_proj": jnp.ones((6, 4)), "o_proj": jnp.ones((4, 4))},
                             "mlp": {"down_proj": jnp.ones((4, 6))}}}}
    out = quantization.quantize_params(params, "fp8")
    assert out["embed"] is params["embed"] and out["lm_head"] is params["lm_head"]
    assert "embed_scale" not in out and "lm_head_scale" not in out
    attn = out["layers"][0]["attn"]
    assert attn["qkv_proj"].dtype == jnp.float8_e4m3fn and attn["qkv_proj_scale"].shape == (6,)
    assert out["layers"][0]["mlp"]["down_proj"].dtype == jnp.float8_e4m3fn
    assert quantization.params_method(out) == "fp8"
    assert quantization.method_of(attn["o_proj"]) == "fp8"
    assert [quantization.method_for(n, "fp8") for n in ("qkv_proj", "embed", "lm_head")] == [
        "fp8", None, None]


@pytest.mark.parametrize("platform,capability,match", [
    ("cpu", None, r"needs a GPU with fp8 matrix units .* platform is cpu \(use int8 there\)$"),
    ("tpu", None, r"needs a GPU .* platform is tpu "),
    ("gpu", "8.0", r"needs a GPU of compute capability >= 8.9 .* this one is 8.0 \(use int8 there\)$"),
])
def test_fp8_is_refused_without_fp8_matrix_units_in_one_line(platform, capability, match):
    with pytest.raises(ValueError, match=r"^quantization='fp8' " + match) as err:
        quantization.check_platform("fp8", platform, capability)
    assert "\n" not in str(err.value)


def test_fp8_passes_on_ada_and_hopper_and_other_methods_anywhere():
    for capability in ("8.9", "9.0", "10.0", None):
        quantization.check_platform("fp8", "gpu", capability)
    for method in (None, "int8", "int4"):
        quantization.check_platform(method, "cpu")
