"""The llama.cpp leg's F32 GGUF: the demo model's Q4_1 source, every tensor dequantized.

The oracle is transformers' own GGUF loader: the written file, read back by
it, must hold the demo model's safetensors bit for bit (the float32 weights
the jaxserve, transformers and vLLM legs run), and the metadata must be the
source's except for the file type. llama.cpp itself is not needed here.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
import torch
import transformers

from benchmarks import llama_cpp_leg


def test_the_f32_twin_holds_the_demo_models_float32_weights(demo_model_dir, demo_gguf_path,
                                                             tmp_path):
    import gguf
    from safetensors.numpy import load_file

    (tmp_path / demo_gguf_path.name).symlink_to(demo_gguf_path)
    written, why = llama_cpp_leg._f32_twin(tmp_path)
    assert written == tmp_path / "SmolLM2-135M-Instruct.F32.gguf" and written.is_file() and not why
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([demo_gguf_path.name,
                                                                 written.name])  # no temporary left
    again, why = llama_cpp_leg._f32_twin(tmp_path)  # two GGUFs now: which one is unclear
    assert again is None and "2 GGUF files" in why

    source, twin = gguf.GGUFReader(str(demo_gguf_path)), gguf.GGUFReader(str(written))
    assert {t.tensor_type for t in twin.tensors} == {gguf.GGMLQuantizationType.F32}
    assert [t.name for t in twin.tensors] == [t.name for t in source.tensors]
    file_type = gguf.Keys.General.FILE_TYPE
    assert twin.get_field(file_type).contents() == gguf.LlamaFileType.ALL_F32
    assert source.get_field(file_type).contents() != gguf.LlamaFileType.ALL_F32
    for name, field in source.fields.items():
        if name != file_type and not name.startswith("GGUF."):
            assert twin.get_field(name).contents() == field.contents(), name
            assert twin.get_field(name).types == field.types, name

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=written.name, dtype=torch.float32)
    ours = load_file(str(demo_model_dir / "model.safetensors"))
    theirs = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, want in ours.items():
        np.testing.assert_array_equal(theirs[name], want, err_msg=name)


def _tiny_gguf(path):
    """A two-tensor Q8_0 GGUF written by ``gguf`` itself; returns its bytes."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    rng = np.random.default_rng(0)
    for name in ("token_embd.weight", "output_norm.weight"):
        weights = rng.standard_normal((4, 64)).astype(np.float32)
        packed = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.mark.parametrize("source, twin", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.F32.gguf"),
    ("SmolLM2-1.7B-Instruct.gguf", "SmolLM2-1.7B-Instruct.F32.gguf"),
    ("Meta-Llama-3-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3-8B-Instruct.F32.gguf"),
    ("qwen2.5-0.5b-instruct-q8_0.gguf", "qwen2.5-0.5b-instruct.F32.gguf"),
    ("model.IQ2_XS.gguf", "model.F32.gguf"),
    ("model-bf16.gguf", "model.F32.gguf"),
])
def test_the_twin_is_named_after_its_source_without_the_quantization(source, twin):
    assert llama_cpp_leg.f32_twin_name(pathlib.Path(source)) == twin


def test_a_small_q8_gguf_gets_its_dequantized_twin(tmp_path):
    import gguf

    _tiny_gguf(tmp_path / "tiny.Q8_0.gguf")
    written, why = llama_cpp_leg._f32_twin(tmp_path)
    assert written == tmp_path / "tiny.F32.gguf" and not why
    source, twin = gguf.GGUFReader(str(tmp_path / "tiny.Q8_0.gguf")), gguf.GGUFReader(str(written))
    for a, b in zip(source.tensors, twin.tensors, strict=True):
        assert b.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.asarray(b.data),
                                      gguf.quants.dequantize(a.data, a.tensor_type))


def _failing_cases():
    def not_a_gguf(folder, monkeypatch):
        (folder / "broken.Q4_1.gguf").write_bytes(b"GGUF but not really")

    def truncated(folder, monkeypatch):
        data = _tiny_gguf(folder / "cut.Q8_0.gguf")
        (folder / "cut.Q8_0.gguf").write_bytes(data[:len(data) * 2 // 3])

    def cannot_dequantize(folder, monkeypatch):
        import gguf

        _tiny_gguf(folder / "odd.Q8_0.gguf")

        def refuse(data, qtype):
            raise NotImplementedError(f"no dequantization for {qtype}")
        monkeypatch.setattr(gguf.quants, "dequantize", refuse)

    def cannot_rename(folder, monkeypatch):  # the temporary file is whole by then
        _tiny_gguf(folder / "full.Q8_0.gguf")

        def refuse(src, dst):
            raise OSError(f"cannot rename {src}")
        monkeypatch.setattr(os, "replace", refuse)

    return [not_a_gguf, truncated, cannot_dequantize, cannot_rename]


@pytest.mark.parametrize("make", _failing_cases(), ids=lambda f: f.__name__)
def test_a_gguf_that_cannot_be_converted_gives_a_reason_and_leaves_no_file(make, tmp_path,
                                                                           monkeypatch):
    make(tmp_path, monkeypatch)
    before = sorted(p.name for p in tmp_path.iterdir())
    written, why = llama_cpp_leg._f32_twin(tmp_path)
    monkeypatch.undo()
    assert written is None and "could not write an F32 twin of" in why and before[0] in why
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no twin, no temporary
