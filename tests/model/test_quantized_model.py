"""Quantized models (``load_model(..., quantization="int8" | "int4" | "fp8")``) against the
float model (fp8 loads and runs on the CPU at this level; the worker refuses to serve it there).

Two checks with different references:

- exactness of the quantized path: the int8 / int4 model computes what the float
  model computes with the dequantized weights (``q · scale``), to float32
  round-off — whether its products run the C++ kernels or the jnp forms;
- closeness to the float checkpoint, with a bound from the quantization error:
  every quantized matrix carries a relative (Frobenius) error ε measured on the
  loaded weights (~0.7 % for absmax int8 of Gaussian rows); to first order the
  errors of the M = 2L + 2 matrices on the path (L layers' attention and MLP, the
  embedding, the LM head) add, each moving the logits by at most ε of their scale
  in a model whose layers do not amplify (initializer range 0.02, as real
  checkpoints), so max |Δlogit| <= M·ε·max|logit|. Greedy tokens agree wherever
  the float model's top-2 gap exceeds twice the measured error. For int4 (ε ~8 % for
  Gaussian groups of 32) that bound is loose, so its closeness is also stated as
  the measured teacher-forced argmax agreement and mean log-likelihood change.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from jaxserve.model import quantization as quant
from jaxserve.model.llama import linear
from jaxserve.model.loader import load_model, save_model_checkpoint
from tests.model.hf_tiny import make_tiny_model
from tests.model.paged_runner import PagedRunner

INIT = 0.02


def _dequantized(params: dict) -> dict:
    """The float model's parameters holding the quantized model's dequantized weights."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = _dequantized(value)
        elif isinstance(key, str) and key.endswith(quant.SCALE_SUFFIX):
            continue
        elif key in quant.QUANTIZED_PARAMS and key + quant.SCALE_SUFFIX in params:
            out[key] = quant.dequantize(value, params[key + quant.SCALE_SUFFIX])
        else:
            out[key] = value
    return out


def _logits(loaded, tokens, backend="cpu"):
    config, graphdef, state = loaded
    return PagedRunner(config, graphdef, state, backend=backend).step(
        {"s": tokens}, all_logits=True)["s"]


KERNEL_DTYPES = {"int8": jnp.int8, "int4": jnp.uint8, "fp8": jnp.float8_e4m3fn}


def _kernel_dtype(method: str, key: str):
    """The dtype of the quantized kernel at pytree path ``key`` (int4 keeps the embedding and
    LM head at int8)."""
    name = key.split("'")[-2]
    return KERNEL_DTYPES[quant.method_for(name, method)]


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("arch,scan_layers", [("LlamaForCausalLM", False),
                                              ("Qwen2ForCausalLM", False),
                                              ("LlamaForCausalLM", True)],
                         ids=["llama-untied", "qwen2-tied-bias", "llama-scanned"])
def test_quantized_model_is_the_float_model_with_dequantized_weights(arch, scan_layers, method,
                                                                    tmp_path):
    make_tiny_model(arch, tmp_path, initializer_range=INIT)
    config, graphdef, q_state = loaded = load_model(tmp_path, scan_layers=scan_layers,
                                                    quantization=method)
    leaves = dict(jax.tree_util.tree_flatten_with_path(q_state)[0])
    dtypes = {jax.tree_util.keystr(p): x.dtype for p, x in leaves.items()}
    kernels = [k for k in dtypes if k.split("'")[-2] in quant.QUANTIZED_PARAMS]
    per_layer = 4  # qkv_proj, o_proj, gate_up_proj, down_proj (stacked once when scanned)
    assert len(kernels) == per_layer * (1 if scan_layers else config.num_layers) + 1 + (
        not config.tie_word_embeddings), kernels  # + the embedding, + an untied LM head
    assert all(dtypes[k] == _kernel_dtype(method, k) for k in kernels), dtypes
    assert all(dtypes[k[:-2] + quant.SCALE_SUFFIX + "']"] == jnp.float32 for k in kernels)
    f_config, f_graphdef, _ = load_model(tmp_path, scan_layers=scan_layers)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 24).tolist()
    got = _logits(loaded, tokens)
    want = _logits((f_config, f_graphdef, _dequantized(q_state)), tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_int8_logits_within_the_quantization_error_of_float(arch, tmp_path):
    make_tiny_model(arch, tmp_path, initializer_range=INIT)
    f_loaded = load_model(tmp_path)
    q_loaded = load_model(tmp_path, quantization="int8")
    # ε: the largest relative Frobenius error of a quantized matrix
    deq = jax.tree.leaves(_dequantized(q_loaded[2]))
    eps = max(float(jnp.linalg.norm(d - f) / jnp.linalg.norm(f))
              for d, f in zip(deq, jax.tree.leaves(f_loaded[2])) if f.ndim == 2)
    assert 0 < eps < 0.01  # absmax int8 of Gaussian rows: ~0.7 %
    config = f_loaded[0]
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 32).tolist()
    want, got = _logits(f_loaded, tokens), _logits(q_loaded, tokens)
    num_matrices = 2 * config.num_layers + 2
    err = np.abs(got - want).max()
    assert err <= num_matrices * eps * np.abs(want).max(), (err, eps, np.abs(want).max())
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * err
    assert clear.sum() >= len(tokens) // 2, clear.sum()
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def _mean_nll(logits: np.ndarray, tokens: list[int]) -> float:
    """Mean negative log-likelihood (nats) of tokens[1:] under logits [T, V] (float64)."""
    x = logits.astype(np.float64)[:-1]
    x -= x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(tokens) - 1), tokens[1:]].mean())


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_int4_logits_close_to_float(arch, tmp_path):
    """int4 (group 32) against the float model, 64 teacher-forced positions.

    Measured on the tiny models of seeds 0-2 of both architectures (V = 256, near-uniform
    logits: mean NLL ~5.55 = ln 256): ε 7.9 %; max |Δlogit| 0.05-0.14 against the bound
    (2L + 2)·ε·max|logit| = 0.38-0.51; argmax agreement 0.84-0.94 (0.875 and 0.94 at seed 0);
    |Δ mean NLL| <= 0.0035 nats (int8: agreement 0.95-1.0, |Δ NLL| <= 0.0004). Thresholds:
    agreement >= 0.75, |Δ NLL| <= 0.01 nats, and the argmax equal wherever the float top-2
    gap exceeds twice the measured error.
    """
    make_tiny_model(arch, tmp_path, initializer_range=INIT)
    f_loaded, q_loaded = load_model(tmp_path), load_model(tmp_path, quantization="int4")
    deq = jax.tree.leaves(_dequantized(q_loaded[2]))
    eps = max(float(jnp.linalg.norm(d - f) / jnp.linalg.norm(f))
              for d, f in zip(deq, jax.tree.leaves(f_loaded[2])) if f.ndim == 2)
    # uniform rounding error of Gaussian groups of 32: step (max - min)/15 ~ 0.27σ, rms step/√12
    assert 0.05 < eps < 0.12, eps
    config = f_loaded[0]
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 64).tolist()
    want, got = _logits(f_loaded, tokens), _logits(q_loaded, tokens)
    err = np.abs(got - want).max()
    assert err <= (2 * config.num_layers + 2) * eps * np.abs(want).max(), (err, eps)
    agreement = (got.argmax(-1) == want.argmax(-1)).mean()
    assert agreement >= 0.75, agreement
    assert abs(_mean_nll(got, tokens) - _mean_nll(want, tokens)) <= 0.01
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * err
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_fp8_logits_close_to_float(arch, tmp_path):
    """fp8 (e4m3 weights per output channel, e4m3 activations per token) against the float
    model, 64 teacher-forced positions on the CPU (XLA widens the fp8 operands exactly).

    Each quantized product carries two errors, the weights' (ε measured on the loaded
    kernels: ~2.5 % for e4m3 of Gaussian rows, 2^-4 relative at most per element) and the
    activations' (as large), so the bound is (4L) · 2ε · max|logit| over the 4L decoder
    products (the embedding and LM head are float). Measured at seed 0 (V = 256, near-uniform
    logits): ε 2.6 %, max |Δlogit| 0.046 / 0.037 (bound 0.44 / 0.37), argmax agreement
    0.89 / 0.94 and Δ mean NLL +0.0014 / -0.0013 nats for Llama / Qwen2 (int8: agreement
    0.95-1.0, |Δ NLL| <= 0.0004). Thresholds: agreement >= 0.85, |Δ NLL| <= 0.005 nats, and
    the argmax equal wherever the float top-2 gap exceeds twice the measured error.
    """
    make_tiny_model(arch, tmp_path, initializer_range=INIT)
    f_loaded, q_loaded = load_model(tmp_path), load_model(tmp_path, quantization="fp8")
    q_state = q_loaded[2]
    assert q_state["layers"][0]["mlp"]["down_proj"].dtype == jnp.float8_e4m3fn
    assert q_state["embed"].dtype == jnp.float32 and "embed_scale" not in q_state
    deq = jax.tree.leaves(_dequantized(q_state))
    eps = max(float(jnp.linalg.norm(d - f) / jnp.linalg.norm(f))
              for d, f in zip(deq, jax.tree.leaves(f_loaded[2])) if f.ndim == 2)
    assert 0.01 < eps < 0.04, eps  # uniform relative rounding of 2^-3-spaced values: ~2.5 %
    config = f_loaded[0]
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 64).tolist()
    want, got = _logits(f_loaded, tokens), _logits(q_loaded, tokens)
    err = np.abs(got - want).max()
    assert err <= 4 * config.num_layers * 2 * eps * np.abs(want).max(), (err, eps)
    agreement = (got.argmax(-1) == want.argmax(-1)).mean()
    assert agreement >= 0.85, agreement
    assert abs(_mean_nll(got, tokens) - _mean_nll(want, tokens)) <= 0.005
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * err
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def _lowered(x, q, scale, **kwargs):
    return jax.jit(lambda a, b, c: linear(a, b, c, **kwargs)).lower(x, q, scale).as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_kernels.available(),
                    reason="the C++ quantized kernels are the CPU's")
@pytest.mark.parametrize("q,scale,target", [
    (jnp.zeros((32, 64), jnp.int8), jnp.ones((32,), jnp.float32), cpu_kernels.MATMUL_I8_TARGET),
    (jnp.zeros((32, 32), jnp.uint8), jnp.ones((32, 2, 2), jnp.float32),
     cpu_kernels.MATMUL_I4_TARGET),
], ids=["int8", "int4"])
def test_quantized_linear_uses_the_kernel_at_every_row_count_on_the_cpu_only(q, scale, target):
    """With AVX-512 at every row count; with 8-lane vectors (AVX2) up to its row cut."""
    cut = cpu_kernels.matmul_max_rows(quantized=True)
    assert cut == (sys.maxsize if cpu_kernels.has_avx512()
                   else cpu_kernels.MATMUL_MAX_ROWS_8_LANES_QUANTIZED)
    for rows in (1, 2, 7, cpu_kernels.MATMUL_MAX_ROWS_8_LANES_QUANTIZED,
                 cpu_kernels.MATMUL_MAX_ROWS_8_LANES_QUANTIZED + 1, 512):
        text = _lowered(jnp.zeros((rows, 64), jnp.float32), q, scale)
        assert (target in text) == (rows <= cut), rows
    # a tensor-parallel split keeps the jnp form (XLA partitions it)
    text = _lowered(jnp.zeros((4, 64), jnp.float32), q, scale, tensor_parallel=True)
    assert target not in text
    # lowered for a GPU: the jnp form (the kernel widened, or dequantized, then a product)
    text = jax.jit(linear).trace(jnp.zeros((4, 64), jnp.float32), q, scale).lower(
        lowering_platforms=("cuda",)).as_text()
    assert target not in text and "dot_general" in text


def test_load_model_refuses_an_unknown_method(tmp_path):
    make_tiny_model("LlamaForCausalLM", tmp_path, initializer_range=INIT)
    with pytest.raises(ValueError,
                       match="quantization must be one of None, 'int8', 'int4', 'fp8'; got 'int3'"):
        load_model(tmp_path, quantization="int3")


def test_int4_refuses_an_input_dimension_off_the_group_size_in_one_line(tmp_path):
    """hidden_size 48 is not a multiple of int4's group of 32: refused at start-up, naming
    the flag and the dimension (int8 loads the same model)."""
    make_tiny_model("LlamaForCausalLM", tmp_path, initializer_range=INIT, hidden_size=48)
    with pytest.raises(ValueError, match=r"^--quantization int4 needs every linear input "
                                         r"dimension to be a multiple of its group size 32; "
                                         r"hidden_size is 48$"):
        load_model(tmp_path, quantization="int4")
    assert load_model(tmp_path, quantization="int8")[2]["embed"].dtype == jnp.int8


def test_int4_refuses_tensor_parallel_in_one_line(tmp_path):
    from jaxserve.engine.config import EngineConfig
    from jaxserve.model import sharding

    make_tiny_model("LlamaForCausalLM", tmp_path, initializer_range=INIT)
    match = r"^quantization='int4' runs on one device; got tensor_parallel_size=2"
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path, mesh=sharding.make_mesh(2), quantization="int4")
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=str(tmp_path), quantization="int4", tensor_parallel_size=2)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_checkpoint_round_trip_and_refusals(method, tmp_path):
    """save-checkpoint records the method: a quantized checkpoint restores the quantized
    parameters bit for bit and is refused (naming quantization) when served without it or
    with the other method, and the other way round."""
    src, out = tmp_path / "hf", tmp_path / "ckpt"
    make_tiny_model("LlamaForCausalLM", src, initializer_range=INIT)
    save_model_checkpoint(src, out, quantization=method)
    _, _, restored = load_model(out, quantization=method)
    _, _, converted = load_model(src, quantization=method)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(converted)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    with pytest.raises(ValueError, match=f"quantization={method}"):
        load_model(out)
    with pytest.raises(ValueError, match=f"quantization={method}"):
        load_model(out, quantization={"int8": "int4", "int4": "int8", "fp8": "int8"}[method])
    save_model_checkpoint(src, tmp_path / "float")
    with pytest.raises(ValueError, match="quantization=None"):
        load_model(tmp_path / "float", quantization=method)


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_quantized_tensor_parallel_matches_one_device(arch, method, tmp_path):
    """TP = 2: every scale is split with its kernel's outputs (or replicated for the
    row-parallel o_proj / down_proj) and the logits are TP = 1's to float32 round-off
    (fp8: a row-parallel input's per-token absmax spans both devices' halves, so its
    scale, and every e4m3 value, is TP = 1's)."""
    from jaxserve.model import sharding

    assert len(jax.devices()) >= 2
    make_tiny_model(arch, tmp_path, initializer_range=INIT, num_attention_heads=8,
                    num_key_value_heads=2, intermediate_size=128)
    tokens = np.random.default_rng(2).integers(0, 256, 20).tolist()
    one = _logits(load_model(tmp_path, quantization=method), tokens, backend="reference")
    mesh = sharding.make_mesh(2)
    config, graphdef, state = load_model(tmp_path, mesh=mesh, quantization=method)
    got = PagedRunner(config, graphdef, state, mesh=mesh).step({"s": tokens},
                                                                all_logits=True)["s"]
    np.testing.assert_allclose(got, one, rtol=0, atol=1e-5 * max(1.0, np.abs(one).max()))
    layer = state["layers"][0]
    split, whole = sharding.TP_AXIS, None
    for module, name, axis in (("attn", "qkv_proj_scale", split), ("mlp", "gate_up_proj_scale", split),
                               ("attn", "o_proj_scale", whole), ("mlp", "down_proj_scale", whole)):
        spec = layer[module][name].sharding.spec
        assert (spec[-1] if len(spec) else None) == axis, (name, spec)
    assert layer["attn"]["qkv_proj"].dtype == KERNEL_DTYPES[method]
    if method == "int8":
        assert state["embed"].dtype == jnp.int8
        assert state["embed_scale"].sharding.spec[-1] == split  # V = 256 splits over 2
    else:  # fp8 keeps the embedding float
        assert state["embed"].dtype == jnp.float32 and "embed_scale" not in state


def test_int8_bfloat16_logits_close_to_bfloat16(tmp_path):
    """bfloat16 (the GPU dtype) with int8 weights: the jnp products (x bf16, q widened to
    bf16 exactly: |q| <= 127 fits 8 significand bits), within the float32 bound plus
    bfloat16's own error (measured against float32 beside it)."""
    make_tiny_model("LlamaForCausalLM", tmp_path, initializer_range=INIT)
    tokens = np.random.default_rng(5).integers(0, 256, 20).tolist()
    f32 = _logits(load_model(tmp_path), tokens, backend="reference")
    bf16 = _logits(load_model(tmp_path, "bfloat16"), tokens, backend="reference")
    q_state = load_model(tmp_path, "bfloat16", quantization="int8")
    assert q_state[2]["layers"][0]["attn"]["qkv_proj"].dtype == jnp.int8
    assert q_state[2]["norm"]["weight"].dtype == jnp.bfloat16
    got = _logits(q_state, tokens, backend="reference")
    assert np.isfinite(got).all()
    scale = np.abs(f32).max()
    bf16_err = np.abs(bf16 - f32).max()
    # (2L + 2)·ε·max|logit| with ε < 1 % (test above), plus twice bf16's own error
    assert np.abs(got - f32).max() <= 6 * 0.01 * scale + 2 * bf16_err


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_step_lowers_for_a_gpu(method, tmp_path):
    """The served body and sampler of a quantized bfloat16 model exported for ``cuda`` (no
    GPU): quantized parameters in, the Pallas attention kernel, and no CPU custom call."""
    from jaxserve.worker.compile_manager import trace_program
    from pallas_kernels.gpu_target import TRITON_CUSTOM_CALL, abstract_gpu
    from tests.worker.tiny_ladder import tiny_pallas_ladder

    ladder = tiny_pallas_ladder(tmp_path, token_buckets=(16,), request_buckets=(8,),
                                quantization=method)
    body = next(e for e in ladder if e.kind == "body")
    sampler = next(e for e in ladder if e.kind == "sampler")
    texts = {}
    for exe in (body, sampler):
        with abstract_gpu():
            program, _ = trace_program(exe, platforms=("cuda",))
        texts[exe.kind] = program.mlir_module()
        assert cpu_kernels.MATMUL_I8_TARGET not in texts[exe.kind], exe.name
        assert cpu_kernels.MATMUL_I4_TARGET not in texts[exe.kind], exe.name
        assert any(a.dtype == KERNEL_DTYPES[method] for a in program.in_avals), exe.name
    assert f"custom_call @{TRITON_CUSTOM_CALL}" in texts["body"]
