"""Orbax checkpoints of the converted parameters: bitwise round trips, sharded restores, refusals."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, SingleDeviceSharding

from jaxserve.config import ModelConfig
from jaxserve.model.checkpoint import (METADATA_FILE, check_metadata, read_metadata,
                                       restore_params, save_params)
from jaxserve.model import sharding
from jaxserve.model.loader import abstract_model, load_model, save_model_checkpoint

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=96,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False)

def random_params(config: ModelConfig, dtype, scan_layers: bool, seed: int = 0) -> dict:
    """The model's parameter pytree (pure dict) filled with fresh normal draws, on device 0."""
    _, abstract = abstract_model(config, dtype, scan_layers)
    leaves, treedef = jax.tree.flatten(abstract)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [
        jnp.asarray(rng.standard_normal(x.shape, np.float32), dtype) for x in leaves])


def tp_target(params: dict, mesh: Mesh, scan_layers: bool) -> dict:
    """ShapeDtypeStructs of ``params`` carrying the tensor-parallel shardings over ``mesh``
    (``jaxserve.model.sharding``: the layout the worker uses)."""
    del scan_layers  # the layout counts split axes from the end: [L] stays whole
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        params, sharding.param_shardings(params, mesh, CONFIG.vocab_size))


def single_device_target(params: dict) -> dict:
    one = SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), params)


def assert_bitwise_equal(restored: dict, original: dict) -> None:
    assert jax.tree.structure(restored) == jax.tree.structure(original)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(restored)[0],
                                 jax.tree.leaves(original)):
        assert got.dtype == want.dtype, path
        got, want = np.asarray(got), np.asarray(want)
        assert got.tobytes() == want.tobytes(), jax.tree_util.keystr(path)


def save(directory, params, *, dtype="float32", scan_layers=False, layout=None, **kwargs):
    save_params(directory, params, config=CONFIG, dtype=dtype, scan_layers=scan_layers,
                layout=layout, **kwargs)


def test_four_simulated_devices():
    assert len(jax.devices()) == 4


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_on_one_device(tmp_path, scan_layers, dtype):
    params = random_params(CONFIG, jnp.dtype(dtype), scan_layers)
    save(tmp_path / "ckpt", params, dtype=dtype, scan_layers=scan_layers)
    restored = restore_params(tmp_path / "ckpt", single_device_target(params))
    assert_bitwise_equal(restored, params)
    assert (0 in restored["layers"]) is not scan_layers  # int layer keys come back as ints


@pytest.mark.parametrize("scan_layers", [False, True])
def test_restore_into_tensor_parallel_shardings(tmp_path, scan_layers):
    params = random_params(CONFIG, jnp.float32, scan_layers)
    save(tmp_path / "ckpt", params, scan_layers=scan_layers, layout={"tensor_parallel_size": 2})
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    target = tp_target(params, mesh, scan_layers)
    restored = restore_params(tmp_path / "ckpt", target)
    assert_bitwise_equal(restored, params)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(restored)[0],
                                 jax.tree.leaves(target)):
        sharding = want.sharding
        assert got.sharding == sharding, path
        # Each of the two devices holds exactly its shard, nothing more.
        shards = got.addressable_shards
        assert {s.device for s in shards} == set(mesh.devices.flat)
        for shard in shards:
            assert shard.data.shape == sharding.shard_shape(got.shape), path
    qkv = restored["layers"]["attn"]["qkv_proj"] if scan_layers else restored["layers"][0]["attn"]["qkv_proj"]
    assert qkv.addressable_shards[0].data.shape[-2] == qkv.shape[-2] // 2  # [out, in]


def test_many_int_layer_keys_restore_by_path(tmp_path):
    """12 layers: as strings "10" sorts before "2"; each layer must still come back as itself."""
    config = dataclasses.replace(CONFIG, num_layers=12)
    params = random_params(config, jnp.float32, scan_layers=False)
    save_params(tmp_path / "ckpt", params, config=config, dtype="float32", scan_layers=False)
    restored = restore_params(tmp_path / "ckpt", single_device_target(params))
    assert sorted(restored["layers"]) == list(range(12))
    assert_bitwise_equal(restored, params)


def test_metadata_round_trip_and_check(tmp_path):
    params = random_params(CONFIG, jnp.float32, scan_layers=False)
    save(tmp_path / "ckpt", params, layout={"tensor_parallel_size": 2})
    meta = read_metadata(tmp_path / "ckpt")
    assert meta["dtype"] == "float32" and meta["scan_layers"] is False
    assert meta["layout"] == {"tensor_parallel_size": 2}
    assert meta["config"] == json.loads(CONFIG.to_json())
    check_metadata(meta, config=CONFIG, dtype="float32", scan_layers=False,
                   layout={"tensor_parallel_size": 2})


@pytest.mark.parametrize("change,field", [
    (dict(dtype="bfloat16"), "dtype"),
    (dict(config=dataclasses.replace(CONFIG, num_kv_heads=4)), "config.num_kv_heads"),
    (dict(scan_layers=True), "scan_layers"),
    (dict(layout={"tensor_parallel_size": 4}), "layout"),
    (dict(layout=None), "layout"),
], ids=["dtype", "config", "scan_layers", "layout", "no-layout"])
def test_mismatching_metadata_is_refused_by_name(tmp_path, change, field):
    params = random_params(CONFIG, jnp.float32, scan_layers=False)
    save(tmp_path / "ckpt", params, layout={"tensor_parallel_size": 2})
    expected = dict(config=CONFIG, dtype="float32", scan_layers=False,
                    layout={"tensor_parallel_size": 2}) | change
    with pytest.raises(ValueError, match=rf"checkpoint {field} is"):
        check_metadata(read_metadata(tmp_path / "ckpt"), **expected)


def test_restore_refuses_another_dtype_and_missing_shardings(tmp_path):
    params = random_params(CONFIG, jnp.float32, scan_layers=False)
    save(tmp_path / "ckpt", params)
    target = single_device_target(params)
    bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding),
                        target)
    with pytest.raises(ValueError, match="stored as float32, target is bfloat16"):
        restore_params(tmp_path / "ckpt", bf16)  # Orbax alone would cast silently
    bare = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target)
    with pytest.raises(ValueError, match="has no sharding"):
        restore_params(tmp_path / "ckpt", bare)


def test_save_refuses_a_dtype_the_params_do_not_have(tmp_path):
    params = random_params(CONFIG, jnp.float32, scan_layers=False)
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        save(tmp_path / "ckpt", params, dtype="bfloat16")


def test_existing_checkpoint_is_kept_unless_forced(tmp_path):
    old = random_params(CONFIG, jnp.float32, scan_layers=False, seed=1)
    new = random_params(CONFIG, jnp.float32, scan_layers=False, seed=2)
    save(tmp_path / "ckpt", old)
    with pytest.raises(FileExistsError, match="force=True"):
        save(tmp_path / "ckpt", new)
    assert_bitwise_equal(restore_params(tmp_path / "ckpt", single_device_target(old)), old)
    save(tmp_path / "ckpt", new, layout={"tensor_parallel_size": 2}, force=True)
    assert_bitwise_equal(restore_params(tmp_path / "ckpt", single_device_target(new)), new)
    assert read_metadata(tmp_path / "ckpt")["layout"] == {"tensor_parallel_size": 2}


def test_a_foreign_directory_is_never_overwritten(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    params = random_params(CONFIG, jnp.float32, scan_layers=False)
    with pytest.raises(FileExistsError, match="no jaxserve checkpoint"):
        save(tmp_path, params, force=True)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_an_empty_existing_directory_is_used(tmp_path):
    params = random_params(CONFIG, jnp.float32, scan_layers=False)
    save(tmp_path, params)
    assert (tmp_path / METADATA_FILE).is_file()
    assert_bitwise_equal(restore_params(tmp_path, single_device_target(params)), params)


def test_unfinished_or_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=METADATA_FILE):
        read_metadata(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a jaxserve checkpoint"):
        restore_params(tmp_path, {})


# --------------------------------------------- a servable checkpoint directory
def test_save_model_checkpoint_restores_bitwise_into_its_mesh(tmp_path):
    from tests.model.hf_tiny import make_tiny_model

    make_tiny_model("Qwen2ForCausalLM", tmp_path / "hf", num_attention_heads=8,
                    num_key_value_heads=2, intermediate_size=128)
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")  # copied along, not read here
    mesh = sharding.make_mesh(2)
    out = save_model_checkpoint(tmp_path / "hf", tmp_path / "ckpt", "float32", mesh=mesh)
    assert (out / METADATA_FILE).is_file() and (out / "config.json").is_file()
    assert (out / "tokenizer.json").is_file() and not list(out.glob("*.safetensors"))
    config, _, converted = load_model(tmp_path / "hf", "float32", mesh=mesh)
    restored_config, _, restored = load_model(out, "float32", mesh=mesh)  # auto: the checkpoint
    assert restored_config == config
    assert_bitwise_equal(restored, converted)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(converted)):
        assert got.sharding == want.sharding
    # Another tensor-parallel size groups the fused output features differently: refused.
    with pytest.raises(ValueError, match="checkpoint config.num_kv_heads is 2, expected 4"):
        load_model(out, "float32", mesh=sharding.make_mesh(4))  # KV heads replicated at TP=4
    with pytest.raises(ValueError, match="checkpoint layout.*converted for "
                                         "tensor_parallel_size=2, dtype=float32"):
        load_model(out, "float32")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors: load it with load_format"):
        load_model(out, "float32", mesh=mesh, load_format="safetensors")
    # The destination is checked before the conversion.
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file, not a directory"):
        save_model_checkpoint(tmp_path / "missing_model", tmp_path / "a_file")
    with pytest.raises(FileExistsError, match="--force"):
        save_model_checkpoint(tmp_path / "missing_model", out)
    with pytest.raises(FileNotFoundError, match="not a jaxserve checkpoint"):
        load_model(tmp_path / "hf", "float32", mesh=mesh, load_format="orbax")
    with pytest.raises(ValueError, match="load_format"):
        load_model(out, "float32", load_format="pickle")


def test_a_checkpoint_of_the_older_kernel_layout_is_refused(tmp_path):
    """A checkpoint written before kernels were kept ``[out, in]`` has no ``kernels`` entry in its
    layout; ``load_model`` refuses it, naming the layout, rather than serving transposed weights."""
    from tests.model.hf_tiny import make_tiny_model

    make_tiny_model("LlamaForCausalLM", tmp_path / "hf")
    out = save_model_checkpoint(tmp_path / "hf", tmp_path / "ckpt", "float32")
    load_model(out, "float32")  # as written: accepted
    meta_path = out / METADATA_FILE
    meta = json.loads(meta_path.read_text())
    assert meta["layout"]["kernels"] == "out_in"
    del meta["layout"]["kernels"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"checkpoint layout is \{'tensor_parallel_size': 1\}, "
                                         r"expected .*'kernels': 'out_in'.*convert the model again"):
        load_model(out, "float32")
