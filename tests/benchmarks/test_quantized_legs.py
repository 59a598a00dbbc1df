"""The ``cpu_side_by_side --quantized`` pieces: the int8 / int4 and Q8_0 / Q4_0 floors' byte
counts and the GGUFs made by llama.cpp's quantizer (skipped where ``llama_cpp`` is not
importable).

Oracles: jaxserve's own loader (the quantized parameters' bytes) and the ``gguf``
package (the quantized files' tensor types and sizes). No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from benchmarks import decode_roofline, llama_cpp_leg


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_decode_bytes_are_the_loaded_parameters(method, tiny_model_dir):
    from jaxserve.model.loader import load_model, param_bytes

    quantized = decode_roofline.weight_bytes(tiny_model_dir, quantization=method)
    f32 = decode_roofline.weight_bytes(tiny_model_dir)
    loaded = load_model(str(tiny_model_dir), "float32", quantization=method)
    assert quantized["all_bytes"] == param_bytes(loaded[2])
    assert quantized["num_params"] == f32["num_params"]
    assert quantized["decode_bytes"] < f32["decode_bytes"] / 3


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_quantized_name_sits_beside_the_f32_twin(kind):
    assert llama_cpp_leg.quantized_name(pathlib.Path("SmolLM2-135M-Instruct.F32.gguf"), kind) == \
        f"SmolLM2-135M-Instruct.{kind}.gguf"


def test_gguf_decode_bytes_counts_an_untied_embedding_out(tmp_path):
    import gguf

    def write(path, names):
        writer = gguf.GGUFWriter(str(path), "llama")
        for name in names:
            writer.add_tensor(name, np.random.default_rng(0).standard_normal((4, 32), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    tied = write(tmp_path / "tied.gguf", ["token_embd.weight", "blk.0.ffn_up.weight"])
    untied = write(tmp_path / "untied.gguf", ["token_embd.weight", "output.weight"])
    assert llama_cpp_leg.gguf_decode_bytes(tied) == 2 * 4 * 32 * 4
    assert llama_cpp_leg.gguf_decode_bytes(untied) == 4 * 32 * 4


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama_cpp (llama-cpp-python) is not importable here")
def test_llama_cpps_quantizer_makes_q8_0_and_q4_0_twins_beside_the_f32_one(demo_gguf_path,
                                                                          tmp_path):
    import gguf

    (tmp_path / demo_gguf_path.name).symlink_to(demo_gguf_path)
    f32, why = llama_cpp_leg._f32_twin(tmp_path)
    assert f32 is not None, why
    # Q8_0: 34 bytes per 32 weights, the file a little over a quarter of F32's bytes; Q4_0:
    # 18 bytes per 32 in the blocks, but llama.cpp keeps the tied embedding at Q8_0 / Q6_K
    for kind, ratio in (("Q8_0", (0.25, 0.3)), ("Q4_0", (0.14, 0.25))):
        path, why = llama_cpp_leg.quantized_gguf(f32, kind)
        assert path == tmp_path / f"SmolLM2-135M-Instruct.{kind}.gguf" and not why
        assert not list(tmp_path.glob("*.tmp"))
        types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
        assert types["blk.0.ffn_up.weight"] == getattr(gguf.GGMLQuantizationType, kind)
        assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
        share = llama_cpp_leg.gguf_decode_bytes(path) / llama_cpp_leg.gguf_decode_bytes(f32)
        assert ratio[0] < share < ratio[1], (kind, share)
        assert llama_cpp_leg.quantized_gguf(f32, kind) == (path, "")  # cached: used as it is
    with pytest.raises(ValueError, match="kind must be one of"):
        llama_cpp_leg.quantized_gguf(f32, "Q2_K")


def test_cpu_side_by_side_quantized_runs_int8_against_its_own_floor(tiny_model_dir, tmp_path):
    """``--quantized`` on a tiny model: the int8 and int4 legs run batch 1; llama.cpp's say why
    not (no GGUF of a tiny model). One row and 8-token steps: three engines' ladders of
    executables (T 1, 4, 8; R 1) compile in a third of the time of the smoke tests' ENGINE."""
    from tests.benchmarks.test_smoke import run_bench

    out = run_bench("cpu_side_by_side", tmp_path, "--model", str(tiny_model_dir), "--quantized",
                    "--batch-sizes", "1", "--prompt-lens", "7", "--output-lens", "6",
                    "--mix-requests", "0", "--prefill-len", "0", "--bandwidth-mib", "64",
                    "--bandwidth-reps", "3", "--skip-hf", "--max-num-seqs", "1",
                    "--max-num-batched-tokens", "8")
    legs, roof, row = out["legs"], out["roofline"], out["table"]["batch1"]
    assert set(legs["jaxserve_int8"]["workloads"]) == {"batch1"}
    assert legs["jaxserve_int8"]["engine_options"]["quantization"] == "int8"
    assert "error" in legs["llama_cpp_q8_0"] and row["llama_cpp_q8_0"] is None
    assert set(legs["jaxserve_int4"]["workloads"]) == {"batch1"}
    assert legs["jaxserve_int4"]["engine_options"]["quantization"] == "int4"
    assert "error" in legs["llama_cpp_q4_0"] and row["llama_cpp_q4_0"] is None
    int4 = decode_roofline.weight_bytes(tiny_model_dir, quantization="int4")["decode_bytes"]
    assert roof["floors"]["jaxserve_int4"]["decode_bytes"] == int4
    int8 = decode_roofline.weight_bytes(tiny_model_dir, quantization="int8")["decode_bytes"]
    floors = roof["floors"]
    assert floors["jaxserve_int8"]["decode_bytes"] == int8
    assert floors["jaxserve"]["decode_bytes"] == roof["weights"]["decode_bytes"]
    assert floors["jaxserve_int8"]["floor_tokens_per_s"] == pytest.approx(
        roof["bandwidth"]["best_gb_s"] * 1e9 / int8)
    assert roof["ratio"]["jaxserve_int8"] == pytest.approx(
        row["jaxserve_int8"] / floors["jaxserve_int8"]["floor_tokens_per_s"])
    assert roof["ratio"]["jaxserve"] == pytest.approx(row["jaxserve"] / roof["floor_tokens_per_s"])
