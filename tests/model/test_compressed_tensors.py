"""Pre-quantized compressed-tensors fp8 checkpoints (vLLM's ``*-FP8`` models) load as "fp8".

The fixture is written here, independently of jaxserve: a tiny random Llama's decoder
linear weights quantized with torch (``torch.float8_e4m3fn``; scale = absmax / 448 per
output channel or per tensor) and saved with safetensors under the compressed-tensors
names and ``quantization_config`` that llm-compressor writes. Checked against it:

- the loaded fp8 kernels and scales are the fixture's bytes and scales, fused as the
  loader fuses (q/k/v and gate/up rows concatenated; with TP = 2 each device holding its
  own heads' and columns' rows and scales), one layer at a time or scanned;
- the logits are those of the transformers model whose linear layers use the dequantized
  weights and quantize their input per token to e4m3 (the oracle, in torch);
- refusals, one line each: another method asked of the checkpoint, an unsupported scheme,
  a decoder kernel left float.

fp8 serving on a CPU is refused (``quantization.check_platform``), so the model is run
here at the model level (``load_model`` and the worker's step body).
"""

import copy
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from jaxserve.compressed_tensors import checkpoint_quantization, resolve_quantization
from jaxserve.model import sharding
from jaxserve.model.loader import load_model, save_model_checkpoint
from tests.model.hf_tiny import hf_logits, make_tiny_model
from tests.model.paged_runner import PagedRunner

E4M3_MAX = 448.0
# A decoder linear layer's weight, as transformers' Llama names it.
LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def _scheme(strategy: str, static: bool) -> dict:
    """A ``quantization_config`` as llm-compressor writes it for FP8 / FP8-dynamic."""
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                   "strategy": "tensor" if static else "token", "dynamic": not static,
                   "observer": "minmax" if static else None}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "kv_cache_scheme": None,
        "ignore": ["lm_head"], "global_compression_ratio": 1.5,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                        "strategy": strategy, "dynamic": False, "group_size": None,
                        "observer": "minmax", "block_structure": None},
            "input_activations": activations}}}


def write_fp8_checkpoint(model, directory, strategy: str = "channel", static: bool = False,
                         scale_dtype: torch.dtype = torch.float32
                         ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Saves ``model`` (a float transformers Llama) to ``directory`` in the compressed-tensors
    fp8 layout; returns {weight name: (e4m3 bytes u8[out, in], scale f32[out])}.

    Per channel: ``weight_scale`` [out, 1]; per tensor: [1], of ``scale_dtype`` (newer
    llm-compressor stores them in the model's bfloat16; the weights are quantized with the
    stored scale). With ``static`` each layer also gets an ``input_scale`` f32[1] (a
    calibrated per-tensor activation scale).
    """
    model.save_pretrained(directory, safe_serialization=True)
    tensors, stored = {}, {}
    for name, w in model.state_dict().items():
        if not LINEAR.fullmatch(name):
            tensors[name] = w.contiguous()
            continue
        w = w.float()
        if strategy == "channel":
            scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX  # [out, 1]
        else:
            scale = (w.abs().amax() / E4M3_MAX).reshape(1)  # [1]
        scale = scale.to(scale_dtype)
        q = (w / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale"] = q, scale
        if static:
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.02])
        stored[name] = (q.view(torch.uint8).numpy(),
                        np.broadcast_to(scale.float().numpy().reshape(-1), (w.shape[0],)))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = _scheme(strategy, static)
    config_file.write_text(json.dumps(config))
    return stored


def _tiny(tmp_path, strategy="channel", static=False, scale_dtype=torch.float32):
    model = make_tiny_model("LlamaForCausalLM", tmp_path / "float", initializer_range=0.02)
    stored = write_fp8_checkpoint(model, tmp_path / "fp8", strategy, static, scale_dtype)
    return model, stored, tmp_path / "fp8"


def _bytes(x) -> np.ndarray:
    return np.asarray(jax.device_get(x)).view(np.uint8)


def _fused(stored: dict, layer: int, module: str, parts: str) -> tuple[np.ndarray, np.ndarray]:
    names = [f"model.layers.{layer}.{module}.{p}_proj.weight" for p in parts.split()]
    return (np.concatenate([stored[n][0] for n in names]),
            np.concatenate([stored[n][1] for n in names]))


KERNELS = (("attn", "qkv_proj", "self_attn", "q k v"), ("attn", "o_proj", "self_attn", "o"),
           ("mlp", "gate_up_proj", "mlp", "gate up"), ("mlp", "down_proj", "mlp", "down"))


@pytest.mark.parametrize("scan_layers", [False, True], ids=["layers", "scanned"])
@pytest.mark.parametrize("strategy,scale_dtype", [("channel", torch.float32),
                                                  ("tensor", torch.float32),
                                                  ("channel", torch.bfloat16)],
                         ids=["channel", "tensor", "channel-bf16-scales"])
def test_fp8_kernels_and_scales_are_the_checkpoints_bytes(strategy, scale_dtype, scan_layers,
                                                          tmp_path):
    """quantization None detects the checkpoint; every decoder kernel is its e4m3 bytes and
    every scale its values widened to f32 (a per-tensor scale on every row), fused in
    order; the embedding, LM head and norms stay float."""
    model, stored, path = _tiny(tmp_path, strategy, scale_dtype=scale_dtype)
    assert checkpoint_quantization(path) == "fp8"
    config, _, params = load_model(path, scan_layers=scan_layers)
    for i in range(config.num_layers):
        layer = (jax.tree.map(lambda x: x[i], params["layers"]) if scan_layers
                 else params["layers"][i])
        for group, name, module, parts in KERNELS:
            q, scale = layer[group][name], layer[group][name + "_scale"]
            assert q.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
            want_q, want_scale = _fused(stored, i, module, parts)
            np.testing.assert_array_equal(_bytes(q), want_q)
            np.testing.assert_array_equal(np.asarray(scale), want_scale)
    assert params["embed"].dtype == jnp.float32 and params["lm_head"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(params["lm_head"]),
                                  model.lm_head.weight.detach().numpy())


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_tensor_parallel_devices_hold_their_rows_and_scales(strategy, tmp_path):
    """TP = 2 (the tiny model: 6 query heads, 2 KV heads, MLP width 160): device d's slice
    of qkv_proj is its own 3 query heads' q rows, then its KV head's k rows, then its v
    rows (gate_up: its 80 gate columns, then its 80 up columns), each row with its scale;
    o_proj / down_proj are split along their inputs and their scales replicated."""
    _, stored, path = _tiny(tmp_path, strategy)
    mesh = sharding.make_mesh(2)
    config, _, params = load_model(path, mesh=mesh, quantization="fp8")
    for i in range(config.num_layers):
        layer = params["layers"][i]
        for group, name, module, parts in KERNELS:
            names = [f"model.layers.{i}.{module}.{p}_proj.weight" for p in parts.split()]
            q_shards, scale_shards = (
                [(_bytes(s.data) if which == 0 else np.asarray(s.data)) for s in sorted(
                    layer[group][key].addressable_shards, key=lambda s: s.device.id)]
                for which, key in ((0, name), (1, name + "_scale")))
            if name in ("o_proj", "down_proj"):  # row-parallel: inputs split, scales whole
                want_q, want_scale = stored[names[0]]
                np.testing.assert_array_equal(np.concatenate(q_shards, axis=1), want_q)
                for got in scale_shards:
                    np.testing.assert_array_equal(got, want_scale)
                continue
            for d in range(2):
                for got, which in ((q_shards[d], 0), (scale_shards[d], 1)):
                    want = np.concatenate([np.array_split(stored[n][which], 2)[d]
                                           for n in names])
                    np.testing.assert_array_equal(got, want)


def _fp8_oracle(model, stored: dict) -> torch.nn.Module:
    """A copy of ``model`` whose decoder linear layers hold the dequantized weights
    (q · scale) and quantize each input row (token) to e4m3 with its own scale
    absmax / 448 before the product: what vLLM's W8A8 fp8 linear computes."""
    oracle = copy.deepcopy(model)

    def quantized_input(module, args):
        (x,) = args
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / E4M3_MAX
        xq = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return (xq.float() * scale,)

    modules = dict(oracle.named_modules())
    with torch.no_grad():
        for name, (q, scale) in stored.items():
            linear = modules[name.removesuffix(".weight")]
            w = torch.from_numpy(q.copy()).view(torch.float8_e4m3fn).float()
            linear.weight.copy_(w * torch.from_numpy(scale.copy())[:, None])
            linear.register_forward_pre_hook(quantized_input)
    return oracle


@pytest.mark.parametrize("strategy,static", [("channel", False), ("tensor", True)])
def test_logits_match_the_dequantized_per_token_fp8_oracle(strategy, static, tmp_path):
    """32 teacher-forced positions against ``_fp8_oracle`` (float32). The two compute the
    same products in a different order (jaxserve: the e4m3 operands' dot, then
    x_scale · w_scale; the oracle: the dequantized operands' dot), so they differ by
    float32 round-off — unless an activation sits on an e4m3 rounding boundary and the two
    round it one step (2^-3 of itself) apart. Measured at these seeds: max |Δlogit| 3e-7
    of max |logit| 0.87 (no activation rounded apart), while the float model is 0.04 away.
    Tolerance 1e-4 of max |logit|: 300 times the round-off, 400 times below the
    quantization's own effect. The static ``input_scale`` is not used: jaxserve's
    activation scales are dynamic per token (docs/model.md), as the oracle's."""
    model, stored, path = _tiny(tmp_path, strategy, static)
    tokens = np.random.default_rng(3).integers(0, 256, 32).tolist()
    want = hf_logits(_fp8_oracle(model, stored), tokens)
    config, graphdef, state = load_model(path)
    got = PagedRunner(config, graphdef, state, backend="cpu").step(
        {"s": tokens}, all_logits=True)["s"]
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)
    # and the quantization is visible: the float model is far from the oracle
    assert np.abs(hf_logits(model, tokens) - want).max() > 0.01 * scale


def test_engine_worker_and_loader_resolve_the_same_method(tmp_path):
    """One resolution (``resolve_quantization``): the engine config's ``for_checkpoint``
    reports fp8 (as ``GetModelInfo`` does), the worker then refuses fp8 on the CPU, and a
    saved parameter checkpoint records fp8."""
    from jaxserve.engine.config import EngineConfig
    from jaxserve.worker import InProcessWorker

    _, _, path = _tiny(tmp_path)
    assert resolve_quantization(path, None) == resolve_quantization(path, "fp8") == "fp8"
    assert EngineConfig(model=str(path)).for_checkpoint().quantization == "fp8"
    assert EngineConfig(model=str(tmp_path / "float")).for_checkpoint().quantization is None
    with pytest.raises(ValueError, match=r"^quantization='fp8' needs a GPU with fp8 matrix"):
        InProcessWorker().initialize(EngineConfig(model=str(path)).worker_init())
    out = save_model_checkpoint(path, tmp_path / "ckpt")
    _, _, restored = load_model(out)
    assert restored["layers"][0]["mlp"]["down_proj"].dtype == jnp.float8_e4m3fn


def test_another_method_is_refused_in_one_line(tmp_path):
    _, _, path = _tiny(tmp_path)
    match = (r"^quantization='int8' but .* holds a pre-quantized compressed-tensors fp8 "
             r"checkpoint; serve it with quantization None or 'fp8'$")
    with pytest.raises(ValueError, match=match):
        load_model(path, quantization="int8")
    from jaxserve.engine.config import EngineConfig
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=str(path), quantization="int8").for_checkpoint()


def _set(config: dict, dotted: str, value) -> None:
    *keys, last = dotted.split(".")
    for key in keys:
        config = config[key]
    config[last] = value


@pytest.mark.parametrize("field,value", [
    ("quant_method", "gptq"),
    ("format", "pack-quantized"),
    ("config_groups.group_0.weights.type", "int"),
    ("config_groups.group_0.weights.num_bits", 4),
    ("config_groups.group_0.weights.strategy", "group"),
    ("config_groups.group_0.weights.strategy", "block"),
    ("config_groups.group_0.weights.dynamic", True),
    ("config_groups.group_0.input_activations.type", "int"),
    ("config_groups.group_0.input_activations.strategy", "group"),
])
def test_unsupported_schemes_are_refused_naming_the_field(field, value, tmp_path):
    """The one-line message names the field and its value, before any weight is read."""
    _, _, path = _tiny(tmp_path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    _set(config["quantization_config"], field, value)
    config_file.write_text(json.dumps(config))
    match = rf"^quantization_config\.{re.escape(field)} is {re.escape(repr(value))}; jaxserve"
    with pytest.raises(ValueError, match=match) as err:
        load_model(path)
    assert "\n" not in str(err.value)


KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
             "symmetric": True}  # llm-compressor's static fp8 KV cache scheme


@pytest.mark.parametrize("key,value", [(None, None), ("type", "int"), ("strategy", "attn_head"),
                                       ("dynamic", True)])
def test_only_a_static_per_tensor_e4m3_kv_cache_scheme_is_accepted(key, value, tmp_path):
    """Its scales are what an fp8 KV cache takes (``loader.kv_cache_scales``); any other
    KV cache scheme is refused naming the field."""
    _, _, path = _tiny(tmp_path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"]["kv_cache_scheme"] = (
        KV_SCHEME if key is None else {**KV_SCHEME, key: value})
    config_file.write_text(json.dumps(config))
    if key is None:
        assert checkpoint_quantization(path) == "fp8"
        return
    with pytest.raises(ValueError, match=rf"^quantization_config\.kv_cache_scheme\.{key} is "
                                         rf"{re.escape(repr(value))}; jaxserve"):
        checkpoint_quantization(path)


def test_a_decoder_kernel_left_float_is_refused(tmp_path):
    """A checkpoint whose ``ignore`` kept one decoder layer float: jaxserve serves every
    decoder kernel in fp8, so it names the tensor rather than quantizing it differently
    from vLLM (which would serve that layer unquantized)."""
    model = make_tiny_model("LlamaForCausalLM", tmp_path / "float", initializer_range=0.02)
    path = tmp_path / "fp8"
    write_fp8_checkpoint(model, path)
    from safetensors.torch import load_file

    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = model.state_dict()[name].contiguous()
    del tensors[name + "_scale"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"^{re.escape(name)} is float32 in a "
                                         r"compressed-tensors fp8 checkpoint"):
        load_model(path)
