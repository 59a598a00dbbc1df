"""The fp8 KV cache (``kv_cache_dtype="fp8"``): e4m3 keys and values with a scale per layer.

- ``quantize_kv`` stores ``x / scale`` rounded to e4m3 and clipped to ±448
  (never NaN), and one layer's write + attention with scales equals the float64
  oracle over the dequantized cache (stored value × scale).
- ``init_kv_cache`` gives an fp8 cache f32[L] scales (1.0 by default), refuses
  scales for other caches, and a block takes a quarter of a float32 block's bytes.
- Through the model's step (layer loop and ``scan_layers``): chunked prefill equals
  one prefill on an fp8 cache, and the logits stay within e4m3's rounding of the
  float32 cache's.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from jaxserve.model import kv_cache
from jaxserve.model.attention import AttentionMetadata, paged_attention, with_schedule
from jaxserve.model.kv_cache import (FP8_DTYPE, FP8_MAX, init_kv_cache, kv_cache_bytes_per_block,
                                     quantize_kv, write_kv)
from jaxserve.model.loader import load_model
from tests.model.hf_tiny import make_tiny_model
from tests.model.paged_runner import PagedRunner
from tests.pallas_kernels.attention_cases import make_case, oracle, relative_error


def test_quantize_kv_scales_rounds_and_clips():
    x = jnp.array([0.0, 0.3, -1.7, 40.0, 900.0, -5000.0, 1e-9], jnp.float32)
    stored = quantize_kv(x, FP8_DTYPE, jnp.float32(2.0))
    assert stored.dtype == FP8_DTYPE
    got = np.asarray(stored, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[4:6], [FP8_MAX, -FP8_MAX])  # 450 and -2500 clipped
    want = np.asarray(jnp.asarray(np.asarray(x[:4]) / 2.0).astype(FP8_DTYPE), np.float32)
    np.testing.assert_array_equal(got[:4], want)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 in its normal range
    np.testing.assert_allclose(got[:4] * 2.0, np.asarray(x[:4]), rtol=2 ** -4)
    assert quantize_kv(x, jnp.bfloat16, None).dtype == jnp.bfloat16


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_kernels.available(),
                    reason="the C++ KV write is the CPU's")
def test_fp8_write_is_in_place_on_the_cpu():
    """XLA's CPU backend has no fp8 update: a plain scatter into an fp8 cache compiled to a
    float16 copy of the whole cache and back. On the CPU write_kv runs the C++ write, whose
    output aliases the cache (no copy of it in the program), with the plain scatter's
    result bit for bit (slots past the cache dropped); lowered for a GPU it is the scatter."""
    shape = (64, 2, 16, 32)
    rng = np.random.default_rng(5)
    cache = jnp.asarray(rng.standard_normal(shape) * 8, jnp.float32).astype(FP8_DTYPE)
    k = jnp.asarray(rng.standard_normal((5, 2, 32)) * 8, jnp.float32)
    slots = jnp.array([0, 17, 5000, 1023, 17 + 16], jnp.int32)  # 5000: past the cache
    scale = jnp.float32(0.5)
    write = jax.jit(lambda c, k, s: kv_cache.write_kv(c, c, k, k, s, scale, scale)[0],
                    donate_argnums=0)
    text = write.lower(cache, k, slots).compile().as_text()
    call = next(line for line in text.splitlines() if cpu_kernels.KV_WRITE_BYTES_TARGET in line)
    assert "output_to_operand_aliasing={{}: (0, {})}" in call  # the output is the cache
    assert "input_output_alias={ {}: (0, {}" in text  # ... which is the donated argument
    dims = ",".join(map(str, shape))
    assert not [line for line in text.splitlines()
                if any(f"{t}[{dims}]" in line for t in ("f16", "bf16", "f32"))]
    assert "copy(" not in text
    # the jnp scatter it replaces, as bytes (no fp8 arithmetic), is the oracle
    q = kv_cache.quantize_kv(k, FP8_DTYPE, scale)
    u8 = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)  # noqa: E731
    expected = u8(cache).at[slots // 16, :, slots % 16].set(u8(q), mode="drop")
    assert not np.array_equal(np.asarray(expected), np.asarray(u8(cache)))
    out = write(jnp.array(cache, copy=True), k, slots)  # the copy is donated
    np.testing.assert_array_equal(np.asarray(u8(out)), np.asarray(expected))
    gpu = jax.jit(lambda c, k, s: kv_cache.write_kv(c, c, k, k, s, scale, scale)[0]).trace(
        cache, k, slots).lower(lowering_platforms=("cuda",)).as_text()
    assert cpu_kernels.KV_WRITE_BYTES_TARGET not in gpu and "scatter" in gpu


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_kernels.available(),
                    reason="the C++ KV write is the CPU's")
def test_write_kv_bytes_refuses_bad_operands():
    cache = jnp.zeros((4, 2, 16, 8), FP8_DTYPE)
    with pytest.raises(ValueError, match="values"):
        cpu_kernels.write_kv_bytes(cache, jnp.zeros((3, 2, 4), FP8_DTYPE), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="one-byte"):
        cpu_kernels.write_kv_bytes(cache.astype(jnp.float32), jnp.zeros((3, 2, 8), jnp.float32),
                                   jnp.zeros(3, jnp.int32))


def test_init_kv_cache_fp8_scales(tiny_config):
    cache = init_kv_cache(tiny_config, 4, 16, FP8_DTYPE)
    assert cache.k[0].dtype == FP8_DTYPE and len(cache.k) == tiny_config.num_layers
    assert cache.k_scale.shape == (tiny_config.num_layers,) and cache.k_scale.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(cache.v_scale), 1.0)
    stacked = init_kv_cache(tiny_config, 4, 16, FP8_DTYPE, stacked=True,
                            scales=(jnp.arange(1.0, tiny_config.num_layers + 1), 0.5))
    np.testing.assert_array_equal(np.asarray(stacked.k_scale),
                                  np.arange(1, tiny_config.num_layers + 1))
    np.testing.assert_array_equal(np.asarray(stacked.v_scale), 0.5)
    assert init_kv_cache(tiny_config, 4, 16).k_scale is None
    with pytest.raises(ValueError, match="fp8 cache"):
        init_kv_cache(tiny_config, 4, 16, jnp.float32, scales=(1.0, 1.0))
    with pytest.raises(ValueError, match="k_scale must be f32"):
        init_kv_cache(tiny_config, 4, 16, FP8_DTYPE, scales=(jnp.ones(7), 1.0))
    assert (4 * kv_cache_bytes_per_block(tiny_config, 16, FP8_DTYPE)
            == kv_cache_bytes_per_block(tiny_config, 16, jnp.float32))


@pytest.mark.parametrize("backend", ["reference", "cpu", "pallas_interpret"])
def test_scaled_write_and_attention_match_oracle(backend):
    """Keys ~ N(0, 30²) and values ~ N(0, 0.02²), far from e4m3's unit range, written with
    scales that bring them back into it; attention over the dequantized cache (stored ×
    scale) is the float64 oracle's to float32 rounding."""
    rng = np.random.default_rng(4)
    case = make_case(rng, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16)
    k_scale, v_scale = jnp.float32(30.0 / 16), jnp.float32(0.02 / 16)
    k_cache = jnp.zeros(case.k_cache.shape, FP8_DTYPE)
    v_cache = jnp.zeros(case.v_cache.shape, FP8_DTYPE)
    owned = np.argwhere(~np.isnan(case.k_cache[:, 0, :, 0]))  # [n, 2] (block, slot)
    slots = jnp.asarray(owned[:, 0] * 16 + owned[:, 1], jnp.int32)
    keys = case.k_cache[owned[:, 0], :, owned[:, 1]] * 30.0  # [n, K, H]
    values = case.v_cache[owned[:, 0], :, owned[:, 1]] * 0.02
    k_cache, v_cache = write_kv(k_cache, v_cache, jnp.asarray(keys), jnp.asarray(values), slots,
                                k_scale, v_scale)
    dequantized = dataclasses.replace(
        case, k_cache=np.asarray(k_cache, np.float32) * np.float32(k_scale),
        v_cache=np.asarray(v_cache, np.float32) * np.float32(v_scale))
    err_k = relative_error(dequantized.k_cache[owned[:, 0], :, owned[:, 1]], keys)
    assert 0 < err_k < 2 ** -4  # e4m3's rounding, not more
    metadata = AttentionMetadata(
        slot_mapping=slots, block_table=jnp.asarray(case.block_table),
        seq_lens=jnp.asarray(case.seq_lens), query_start_loc=jnp.asarray(case.query_start_loc))
    if backend == "pallas_interpret":
        metadata = with_schedule(metadata, num_tokens=len(case.q), num_heads=6, k_cache=k_cache,
                                 backend=backend, dtype=jnp.float32)
    out = paged_attention(jnp.asarray(case.q), k_cache, v_cache, metadata, sm_scale=0.125,
                          backend=backend, k_scale=k_scale, v_scale=v_scale)
    want = oracle(dequantized, sm_scale=0.125)
    assert relative_error(np.asarray(out), want) < 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_model("LlamaForCausalLM", directory, seed=3)
    return directory


@pytest.fixture(scope="module")
def tiny_config(model_dir):
    return load_model(model_dir, "float32")[0]


@pytest.fixture(scope="module", params=[False, True], ids=["layers", "scan_layers"])
def model(request, model_dir):
    return load_model(model_dir, "float32", scan_layers=request.param)


def _prefill(model, tokens, chunks, cache_dtype, seed=0):
    config, graphdef, state = model
    runner = PagedRunner(config, graphdef, state, cache_dtype=cache_dtype, seed=seed)
    parts, start = [], 0
    for n in chunks:
        parts.append(runner.step({"s": tokens[start:start + n], "other": [3]},
                                 all_logits=True)["s"])
        start += n
    return np.concatenate(parts)


def test_model_on_fp8_cache(model, monkeypatch):
    """The oracle: a float32 cache whose writes are rounded through e4m3 (fake quantization);
    the fp8 cache must give its logits (e4m3 widens exactly), chunked or not."""
    tokens = np.random.default_rng(2).integers(0, 256, 48).tolist()
    whole = _prefill(model, tokens, (48,), FP8_DTYPE)
    chunked = _prefill(model, tokens, (16, 31, 1), FP8_DTYPE, seed=5)
    np.testing.assert_allclose(chunked, whole, atol=5e-5, rtol=0)  # the paged_equivalence bound
    wide = _prefill(model, tokens, (48,), jnp.float32)
    assert relative_error(whole, wide.astype(np.float64)) > 1e-3  # the cache really is e4m3

    def fake(x, dtype, scale):  # every write rounded to e4m3 (scale 1) in a float32 cache
        return x.astype(FP8_DTYPE).astype(dtype)

    jax.clear_caches()  # the step is traced again with the fake write
    monkeypatch.setattr(kv_cache, "quantize_kv", fake)
    faked = _prefill(model, tokens, (48,), jnp.float32)
    monkeypatch.undo()
    jax.clear_caches()
    np.testing.assert_allclose(whole, faked, atol=5e-5, rtol=0)


def test_tensor_parallel_fp8_cache_equals_one_device(model_dir):
    """TP=2 splits the fp8 cache over KV heads with the scales replicated: the logits of one
    device's run."""
    from jaxserve.model.sharding import make_mesh

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    tokens = np.random.default_rng(2).integers(0, 256, 20).tolist()
    one = _prefill(load_model(model_dir, "float32"), tokens, (12, 8), FP8_DTYPE)
    mesh = make_mesh(2)
    config, graphdef, state = load_model(model_dir, "float32", mesh=mesh)
    runner = PagedRunner(config, graphdef, state, cache_dtype=FP8_DTYPE, mesh=mesh)
    assert runner.kv_cache.k_scale.sharding.is_fully_replicated
    two = np.concatenate([runner.step({"s": tokens[:12], "other": [3]}, all_logits=True)["s"],
                          runner.step({"s": tokens[12:], "other": [3]}, all_logits=True)["s"]])
    np.testing.assert_allclose(two, one, atol=5e-5, rtol=0)
