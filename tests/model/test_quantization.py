"""Weight-only int8 quantization (``jaxserve.model.quantization``): the round trip's error
bound, the embedding lookup, the parameter-tree rewrite and the method check; int4 taken
from llama.cpp Q4_1 blocks against the gguf package's dequantization."""

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
