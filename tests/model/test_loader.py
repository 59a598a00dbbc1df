"""Loading Hugging Face directories: dtypes, tied embeddings, and clear errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import SUPPORTED_ARCHITECTURES
from jaxserve.model.loader import load_model, resolve_dtype
from tests.model.hf_tiny import hf_logits, make_tiny_model
from tests.model.paged_runner import PagedRunner


def test_unsupported_architecture_lists_supported(tmp_path):
    make_tiny_model("LlamaForCausalLM", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError) as info:
        load_model(tmp_path)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(info.value)
    assert "GPT2LMHeadModel" in str(info.value)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    make_tiny_model("LlamaForCausalLM", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path)


@pytest.mark.parametrize("arch,tied", [("Qwen2ForCausalLM", True), ("LlamaForCausalLM", False)])
def test_tied_and_untied_heads(arch, tied, tmp_path):
    hf = make_tiny_model(arch, tmp_path)
    config, _, state = load_model(tmp_path)
    assert config.tie_word_embeddings is tied
    if tied:
        assert "lm_head" not in state
    else:
        np.testing.assert_array_equal(np.asarray(state["lm_head"][...]),
                                      hf.lm_head.weight.detach().numpy())


def test_bfloat16_weights_and_logits(tmp_path):
    hf = make_tiny_model("LlamaForCausalLM", tmp_path)
    config, graphdef, state = load_model(tmp_path, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype(jnp.bfloat16)}
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 20).tolist()
    runner = PagedRunner(config, graphdef, state, cache_dtype=jnp.bfloat16)
    logits = runner.step({"s": tokens}, all_logits=True)["s"]
    expected = hf_logits(hf, tokens)
    # bf16 keeps 8 mantissa bits: per-layer rounding of ~2^-8 relative, compounded
    # over 2 layers; the logits stay within 5% of their scale and agree on the argmax
    # wherever float32's top-2 gap exceeds that error.
    scale = np.abs(expected).max()
    err = np.abs(logits - expected).max()
    assert err < 0.05 * scale, (err, scale)
    gap = np.sort(expected, axis=-1)
    clear = (gap[:, -1] - gap[:, -2]) > 2 * err
    assert clear.any()
    np.testing.assert_array_equal(logits.argmax(-1)[clear], expected.argmax(-1)[clear])


def test_resolve_dtype():
    assert resolve_dtype("bfloat16") == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8")


def test_auto_dtype_is_float32_on_cpu_and_bfloat16_on_an_accelerator():
    """dtype "auto" (the default of LLM, serve and EngineConfig) follows the platform."""
    from jaxserve.engine.config import EngineConfig
    from jaxserve.llm import LLM
    from jaxserve.model.loader import served_dtype

    assert served_dtype("auto", "cpu") == "float32"
    assert served_dtype("auto", "gpu") == served_dtype("auto", "tpu") == "bfloat16"
    assert served_dtype("float32", "gpu") == "float32"  # an explicit choice stays
    assert served_dtype("bfloat16", "cpu") == "bfloat16"
    import inspect

    assert inspect.signature(LLM).parameters["dtype"].default == "auto"
    assert EngineConfig(model=None).dtype == "auto"


def test_a_worker_asked_for_auto_serves_float32_on_the_cpu(tmp_path):
    import jax.numpy as jnp

    from jaxserve.step_plan import WorkerInit
    from jaxserve.worker.in_process import InProcessWorker
    from tests.model.hf_tiny import make_tiny_model

    make_tiny_model("LlamaForCausalLM", tmp_path)
    worker = InProcessWorker()
    worker.initialize(WorkerInit(model=str(tmp_path), dtype="auto", block_size=8,
                                 num_kv_blocks=16, kv_cache_bytes=None, max_num_seqs=2,
                                 max_model_len=64, token_buckets=(8,), request_buckets=(2,),
                                 precompile=False))
    assert worker.init.dtype == "float32"
    assert worker.kv_cache.k[0].dtype == jnp.float32
