"""``LLM(quantization="int8" | "int4")``, ``jaxserve save-checkpoint -q``, what reports the
method, and fp8's refusal on a CPU.

A tiny random-weight Llama (initializer range 0.02, as real checkpoints). The
quantized LLM's greedy first tokens are the argmax of the quantized model's logits run
through the worker's step body (``tests/model/test_quantized_model.py`` checks
those logits against the float model); a checkpoint saved with ``-q`` restores into
an LLM of the same method with the same tokens, and is refused without it.
Prompts are token ids (the demo tokenizer only detokenizes; V is 256). The demo model
itself, with int4 kernels from its GGUF's Q4_1 blocks, generates its own greedy tokens.
"""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.client.types import model_info_from_proto
from jaxserve.engine.config import CacheConfig, EngineConfig
from jaxserve.engine.service import engine_info
from jaxserve.model.loader import load_model
from jaxserve.proto import generate_pb2 as pb
from jaxserve.step_plan import Geometry
from tests.model.hf_tiny import make_tiny_model
from tests.model.paged_runner import PagedRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _generate(model_dir, tokenizer_dir, prompts, **kwargs):
    with LLM(str(model_dir), tokenizer=str(tokenizer_dir), max_num_seqs=4,
             max_num_batched_tokens=32, max_model_len=128, strict_recompile=True,
             token_buckets=(8, 32), request_buckets=(4,), **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_int8")
    make_tiny_model("LlamaForCausalLM", directory, initializer_range=0.02)
    rng = np.random.default_rng(11)
    return directory, [rng.integers(1, 256, n).tolist() for n in (5, 19, 30)]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_llm_generates_the_quantized_models_greedy_tokens(method, tiny, demo_model_dir,
                                                                   tmp_path):
    directory, prompts = tiny
    got = _generate(directory, demo_model_dir, [{"prompt_token_ids": p} for p in prompts],
                    quantization=method)
    assert all(len(t) == GREEDY.max_tokens and all(0 <= i < 256 for i in t) for t in got)
    config, graphdef, state = load_model(directory, quantization=method)
    runner = PagedRunner(config, graphdef, state, backend="cpu")
    logits = runner.step({f"s{i}": p for i, p in enumerate(prompts)})
    assert [t[0] for t in got] == [int(logits[f"s{i}"].argmax()) for i in range(len(prompts))]

    # save-checkpoint -q records the method: served with it, the same tokens
    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-m", "jaxserve", "save-checkpoint", "--model",
                           str(directory), "--output", str(out), "-q", method],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"serve it with: jaxserve serve --model {out} --dtype float32 -q {method})" in proc.stderr
    assert _generate(out, demo_model_dir, [{"prompt_token_ids": p} for p in prompts],
                     quantization=method) == got
    with pytest.raises(ValueError, match=f"quantization={method}"):  # served without it: refused
        _generate(out, demo_model_dir, [{"prompt_token_ids": prompts[0]}])


def test_int4_demo_model_generates_from_its_gguf_blocks(demo_model_dir):
    """The demo model's int4 kernels come from its GGUF's Q4_1 blocks (bit-equal to gguf's
    dequantization: ``tests/model/test_gguf_source.py``); the LLM's greedy first tokens are
    the argmax of that loaded model's logits."""
    from transformers import AutoTokenizer

    from jaxserve.model.gguf_source import GGUF_SOURCE_FILE
    from tests.demo_prompts import TEXTS

    assert (demo_model_dir / GGUF_SOURCE_FILE).is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_dir))
    prompts = [tokenizer.encode(text) for text in TEXTS[:3]]
    got = _generate(demo_model_dir, demo_model_dir, [{"prompt_token_ids": p} for p in prompts],
                    quantization="int4")
    assert all(len(t) == GREEDY.max_tokens for t in got)
    config, graphdef, state = load_model(demo_model_dir, quantization="int4")
    logits = PagedRunner(config, graphdef, state, backend="cpu").step(
        {f"s{i}": p for i, p in enumerate(prompts)})
    assert [t[0] for t in got] == [int(logits[f"s{i}"].argmax()) for i in range(len(prompts))]


def test_llm_refuses_an_unsupported_quantization_in_one_line(tiny, demo_model_dir):
    directory, _ = tiny
    with pytest.raises(ValueError, match=r"^quantization must be one of None, 'int8', 'int4', 'fp8'; got 'awq'$"):
        LLM(str(directory), tokenizer=str(demo_model_dir), quantization="awq")


def test_engine_and_model_info_report_the_quantization():
    geometry = Geometry(num_kv_blocks=9, block_size=16, max_model_len=64, vocab_size=256,
                        eos_token_ids=(0,))
    for method, reported in (("int8", "int8"), ("int4", "int4"), ("fp8", "fp8"), (None, "")):
        core = types.SimpleNamespace(config=EngineConfig(model="/m", quantization=method),
                                     geometry=geometry)
        assert engine_info(core).quantization == reported
    for method in ("int8", "fp8"):
        info = model_info_from_proto(pb.GetModelInfoResponse(model="m", quantization=method))
        assert info.quantization == method


def test_engine_and_model_info_report_the_kv_cache_dtype():
    geometry = Geometry(num_kv_blocks=9, block_size=16, max_model_len=64, vocab_size=256,
                        eos_token_ids=(0,))
    for kv in ("auto", "fp8", "fp8_e4m3"):
        core = types.SimpleNamespace(
            config=EngineConfig(model="/m", cache=CacheConfig(kv_cache_dtype=kv)), geometry=geometry)
        assert engine_info(core).kv_cache_dtype == kv
    info = model_info_from_proto(pb.GetModelInfoResponse(model="m", kv_cache_dtype="fp8"))
    assert info.kv_cache_dtype == "fp8"


def test_llm_refuses_fp8_on_the_cpu_in_one_line(tiny, demo_model_dir):
    """fp8 needs fp8 matrix units: the worker refuses it at start-up on a CPU, naming
    quantization and the platform (its numerics are tested at the function level,
    tests/model/test_quantization.py)."""
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU's refusal")
    directory, _ = tiny
    with pytest.raises(ValueError, match=r"^quantization='fp8' needs a GPU with fp8 matrix "
                                         r"units .*platform is cpu") as err:
        _generate(directory, demo_model_dir, [{"prompt_token_ids": [1, 2, 3]}],
                  quantization="fp8")
    assert "\n" not in str(err.value)


def test_fp8_kv_cache_holds_four_times_the_blocks_and_generates(tiny, demo_model_dir):
    """``LLM(kv_cache_dtype="fp8")``: the same ``kv_cache_bytes`` hold 4× the float32 cache's
    blocks, and the greedy first tokens are the argmax of the model's step body on an fp8
    cache (``tests/model/test_kv_cache_fp8.py`` checks that step against fake quantization)."""
    directory, prompts = tiny
    blocks, firsts = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(str(directory), tokenizer=str(demo_model_dir), max_num_seqs=4,
                 max_num_batched_tokens=32, max_model_len=128, strict_recompile=True,
                 token_buckets=(8, 32), request_buckets=(4,), kv_cache_bytes=1 << 20,
                 kv_cache_dtype=kv_cache_dtype) as llm:
            blocks[kv_cache_dtype] = llm.engine.geometry.num_kv_blocks
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                use_tqdm=False)
            firsts[kv_cache_dtype] = [o.outputs[0].token_ids[0] for o in outs]
    assert blocks["fp8"] == 4 * blocks["auto"], blocks
    config, graphdef, state = load_model(directory)
    runner = PagedRunner(config, graphdef, state, backend="cpu", cache_dtype="float8_e4m3fn")
    logits = runner.step({f"s{i}": p for i, p in enumerate(prompts)})
    assert firsts["fp8"] == [int(logits[f"s{i}"].argmax()) for i in range(len(prompts))]


def test_llm_refuses_an_unsupported_kv_cache_dtype_in_one_line(tiny, demo_model_dir):
    directory, _ = tiny
    with pytest.raises(ValueError, match=r"^kv_cache_dtype must be one of 'auto', 'fp8', "
                                         r"'fp8_e4m3'; got 'fp8_e5m2'$"):
        LLM(str(directory), tokenizer=str(demo_model_dir), kv_cache_dtype="fp8_e5m2")


def _with_kv_scales(source, directory, layers) -> tuple[np.ndarray, np.ndarray]:
    """A copy of ``source`` whose safetensors file also holds llm-compressor's per-layer
    ``self_attn.k_scale`` / ``v_scale`` for ``layers``; returns the (k, v) f32[L] written."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, directory)
    tensors = load_file(directory / "model.safetensors")
    num_layers = 1 + max(int(n.split(".")[2]) for n in tensors if n.startswith("model.layers."))
    k, v = np.linspace(0.5, 2.0, num_layers, dtype=np.float32), np.full(num_layers, 0.25, np.float32)
    for i in layers:
        tensors[f"model.layers.{i}.self_attn.k_scale"] = k[i:i + 1]
        tensors[f"model.layers.{i}.self_attn.v_scale"] = v[i:i + 1]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return k, v


def test_fp8_kv_cache_takes_the_checkpoints_calibrated_scales(tiny, demo_model_dir, tmp_path):
    """A checkpoint storing ``self_attn.k_scale`` / ``v_scale`` (llm-compressor's KV cache
    scales): an fp8 cache takes them, and the greedy first tokens are the step body's on a
    cache with those scales; a checkpoint with some layers' scales only is refused."""
    import dataclasses

    import jax.numpy as jnp

    from jaxserve.model.loader import kv_cache_scales

    directory, prompts = tiny
    k, v = _with_kv_scales(directory, tmp_path / "scaled", layers=range(2))
    got = kv_cache_scales(tmp_path / "scaled", 2)
    np.testing.assert_array_equal(got[0], k)
    np.testing.assert_array_equal(got[1], v)
    assert kv_cache_scales(directory, 2) is None
    with LLM(str(tmp_path / "scaled"), tokenizer=str(demo_model_dir), max_num_seqs=4,
             max_num_batched_tokens=32, max_model_len=128, strict_recompile=True,
             token_buckets=(8, 32), request_buckets=(4,), num_kv_blocks=40,
             kv_cache_dtype="fp8") as llm:
        np.testing.assert_array_equal(np.asarray(llm.engine.worker.kv_cache.k_scale), k)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    config, graphdef, state = load_model(tmp_path / "scaled")
    runner = PagedRunner(config, graphdef, state, backend="cpu", cache_dtype="float8_e4m3fn")
    runner.kv_cache = dataclasses.replace(runner.kv_cache, k_scale=jnp.asarray(k),
                                          v_scale=jnp.asarray(v))
    logits = runner.step({f"s{i}": p for i, p in enumerate(prompts)})
    assert ([o.outputs[0].token_ids[0] for o in outs]
            == [int(logits[f"s{i}"].argmax()) for i in range(len(prompts))])
    _with_kv_scales(directory, tmp_path / "partial", layers=[0])
    with pytest.raises(ValueError, match=r"stores fp8 KV cache scales for some layers but not "
                                         r"'model\.layers\.1\.self_attn\.k_scale'"):
        kv_cache_scales(tmp_path / "partial", 2)
