"""The llama.cpp leg's F32 GGUF: the demo model's Q4_1 source, every tensor dequantized.

The oracle is transformers' own GGUF loader: the written file, read back by
it, must hold the demo model's safetensors bit for bit (the float32 weights
the jaxserve, transformers and vLLM legs run), and the metadata must be the
source's except for the file type. llama.cpp itself is not needed here.
"""

from __future__ import annotations

import numpy as np
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

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=written.name, dtype=torch.float32)
    ours = load_file(str(demo_model_dir / "model.safetensors"))
    theirs = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, want in ours.items():
        np.testing.assert_array_equal(theirs[name], want, err_msg=name)


def test_a_gguf_that_cannot_be_read_gives_a_reason_and_no_file(tmp_path):
    (tmp_path / "broken.Q4_1.gguf").write_bytes(b"GGUF but not really")
    written, why = llama_cpp_leg._f32_twin(tmp_path)
    assert written is None and "broken.Q4_1.gguf" in why
    assert [p.name for p in tmp_path.iterdir()] == ["broken.Q4_1.gguf"]
