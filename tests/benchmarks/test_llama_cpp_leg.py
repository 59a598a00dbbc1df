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
    written = llama_cpp_leg._f32_twin(tmp_path)
    assert written == tmp_path / "SmolLM2-135M-Instruct.F32.gguf" and written.is_file()
    assert llama_cpp_leg._f32_twin(tmp_path) is None  # two GGUFs now: which to convert is unclear

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
