"""int4 kernels taken from the demo model's GGUF source (``jaxserve.model.gguf_source``,
``load_model(..., quantization="int4")``) against the gguf package's dequantization.

Oracle: ``gguf.quants.dequantize`` of each GGUF tensor, its q / k rows put in HF order
(``unpermute_rotary_rows``, itself checked against llama.cpp's rotary convention in
``test_demo_conversion.py``) and fused as the model fuses them (q, k, v and gate, up
along the output rows). Every directly loaded kernel, dequantized with
``quantization.dequantize``, must equal it bit for bit in float32; the Q8_0 embedding
keeps the float32 path (the safetensors are its exact dequantization, re-quantized to
int8). The re-quantizing path (the same directory without its record) gives the same
parameter tree.
"""

from __future__ import annotations

import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.demo.tensors import unpermute_rotary_rows
from jaxserve.model import quantization as quant
from jaxserve.model.gguf_source import GGUF_SOURCE_FILE, open_gguf_source
from jaxserve.model.loader import load_model

# The fused kernels: GGUF tensors of layer i, in the order the model fuses them.
KERNELS = {("attn", "qkv_proj"): ("attn_q", "attn_k", "attn_v"),
           ("attn", "o_proj"): ("attn_output",),
           ("mlp", "gate_up_proj"): ("ffn_gate", "ffn_up"),
           ("mlp", "down_proj"): ("ffn_down",)}


@pytest.fixture(scope="module")
def gguf_tensors(demo_gguf_path):
    import gguf

    return {t.name: t for t in gguf.GGUFReader(str(demo_gguf_path)).tensors}


@pytest.fixture(scope="module")
def direct(demo_model_dir):
    return load_model(demo_model_dir, quantization="int4")


def _without_record(demo_model_dir, directory):
    """A copy of the demo directory (files linked) that names no GGUF source."""
    directory.mkdir()
    for f in demo_model_dir.iterdir():
        if f.name != GGUF_SOURCE_FILE:
            (directory / f.name).symlink_to(f)
    return directory


def _reference(gguf_tensors, layer: int, parts: tuple[str, ...], config) -> np.ndarray:
    """f32[out, in]: gguf's dequantization of layer ``layer``'s ``parts``, HF rows, fused."""
    from gguf.quants import dequantize

    rows = []
    for part in parts:
        tensor = gguf_tensors[f"blk.{layer}.{part}.weight"]
        w = dequantize(tensor.data, tensor.tensor_type)
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(part)
        rows.append(w if heads is None else unpermute_rotary_rows(w, heads))
    return np.concatenate(rows)


def test_the_demo_gguf_holds_q4_1_kernels_a_q8_0_embedding_and_f32_norms(gguf_tensors,
                                                                         demo_model_dir):
    kinds = collections.Counter((name.split(".")[-2], t.tensor_type.name)
                                for name, t in gguf_tensors.items())
    layers = 30
    assert kinds == {**{(part, "Q4_1"): layers for parts in KERNELS.values() for part in parts},
                     ("attn_norm", "F32"): layers, ("ffn_norm", "F32"): layers,
                     ("output_norm", "F32"): 1, ("token_embd", "Q8_0"): 1}, kinds
    source = open_gguf_source(demo_model_dir)  # the record's table: the reader's
    types = source.tensor_types()
    assert len(types) == len(gguf_tensors)
    assert types["model.layers.7.self_attn.k_proj.weight"] == "Q4_1"
    assert types["model.embed_tokens.weight"] == "Q8_0"
    for entry in source.tensors.values():
        tensor = gguf_tensors[entry["gguf_name"]]
        assert (entry["type"], entry["offset"], entry["shape"]) == (
            tensor.tensor_type.name, tensor.data_offset, list(reversed(tensor.shape.tolist())))


def test_every_direct_int4_kernel_is_bit_equal_to_ggufs_dequantization(direct, gguf_tensors,
                                                                      demo_model_dir,
                                                                      demo_gguf_path):
    assert open_gguf_source(demo_model_dir).path == demo_gguf_path.resolve()
    config, _, params = direct
    for layer in range(config.num_layers):
        for (module, name), parts in KERNELS.items():
            q = params["layers"][layer][module][name]
            scale = params["layers"][layer][module][name + quant.SCALE_SUFFIX]
            assert q.dtype == jnp.uint8 and scale.dtype == jnp.float32
            # the scale is the blocks' float16 (d, m), not a re-quantization's float32 step
            assert np.array_equal(scale, np.asarray(scale).astype(np.float16).astype(np.float32))
            got = np.asarray(quant.dequantize(q, scale))
            want = _reference(gguf_tensors, layer, parts, config)
            assert got.dtype == want.dtype == np.float32
            assert np.array_equal(got, want), (layer, name, np.abs(got - want).max())


def test_the_q8_0_embedding_takes_the_float32_path(direct, gguf_tensors, demo_model_dir):
    """Q8_0's float16 step per 32 inputs has no exact int8 (per-row) form: the embedding is
    the safetensors' — gguf's dequantization bit for bit — quantized to int8 at load."""
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    embed = load_file(str(demo_model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    tensor = gguf_tensors["token_embd.weight"]
    assert np.array_equal(embed, dequantize(tensor.data, tensor.tensor_type))
    q, scale = quant.quantize(jnp.asarray(embed), "int8")
    params = direct[2]
    assert np.array_equal(params["embed"], q) and np.array_equal(params["embed_scale"], scale)


def test_direct_and_requantized_int4_give_the_same_parameter_tree(direct, demo_model_dir,
                                                                   tmp_path):
    """Same structure, shapes and dtypes; every parameter but the int4 kernels bit-equal; the
    re-quantized kernels (of the float32 dequantized Q4_1 weights) within float32 round-off
    of the direct ones, whose grid they find again."""
    _, _, params = direct
    _, _, old = load_model(_without_record(demo_model_dir, tmp_path / "old"), quantization="int4")
    assert jax.tree.structure(params) == jax.tree.structure(old)
    flat, flat_old = (jax.tree_util.tree_flatten_with_path(p)[0] for p in (params, old))
    int4 = 0
    for (path, a), (_, b) in zip(flat, flat_old):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), path
        if a.dtype != jnp.uint8 and not jax.tree_util.keystr(path).endswith("_scale']"):
            assert np.array_equal(a, b), path  # norms, the int8 embedding and its scale
    for layer, layer_old in zip(params["layers"].values(), old["layers"].values()):
        for module, name in KERNELS:
            s = name + quant.SCALE_SUFFIX
            a = np.asarray(quant.dequantize(layer[module][name], layer[module][s]))
            b = np.asarray(quant.dequantize(layer_old[module][name], layer_old[module][s]))
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-6 * np.abs(a).max())
            int4 += 1
    assert int4 == 4 * len(params["layers"])


def test_scanned_direct_load_stacks_the_layers(direct, demo_model_dir):
    _, _, params = direct
    _, _, scanned = load_model(demo_model_dir, scan_layers=True, quantization="int4")
    for module, name in KERNELS:
        for key in (name, name + quant.SCALE_SUFFIX):
            want = np.stack([np.asarray(layer[module][key]) for layer in params["layers"].values()])
            assert np.array_equal(scanned["layers"][module][key], want), key


def test_a_missing_or_changed_source_is_not_used(demo_model_dir, demo_gguf_path, tmp_path, caplog):
    directory = _without_record(demo_model_dir, tmp_path / "model")
    assert open_gguf_source(directory) is None  # no record: nothing to use, nothing said
    record = json.loads((demo_model_dir / GGUF_SOURCE_FILE).read_text())
    for change, said in (({"path": str(tmp_path / "gone.gguf")}, "which is missing"),
                         ({"bytes": record["bytes"] + 1}, f"the record says {record['bytes'] + 1}"),
                         ({"sha256": "0" * 64}, "another sha256"),
                         ({}, None)):
        entry = {**record, "path": str(demo_gguf_path), **change}
        (directory / GGUF_SOURCE_FILE).write_text(json.dumps(entry))
        caplog.clear()
        got = open_gguf_source(directory)
        if said is None:
            assert got.path == demo_gguf_path.resolve() and not caplog.records
        else:
            assert got is None and said in caplog.text and "safetensors alone" in caplog.text
    (directory / GGUF_SOURCE_FILE).write_text('{"path": "x.gguf"}')
    with pytest.raises(ValueError, match="is not a GGUF source record"):
        open_gguf_source(directory)

