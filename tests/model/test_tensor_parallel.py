"""Tensor parallelism of the model: TP = 2 and 4 against TP = 1 and transformers.

The test process has four simulated CPU devices (tests/conftest.py). Tiny
random-weight models with 8 query heads and 2 KV heads, so that TP = 2 splits
the KV heads and TP = 4 replicates them (``jaxserve.model.sharding``), run a
30-token prefill and 10 decode steps through the worker's step body on a
paged cache. Bounds: max |Δlogit| <= 1e-5 against TP = 1 (float32 round-off
of the all-reduced partial sums; observed ~1e-5 at logits of magnitude ~10,
so the bound is relative to the largest logit) and 1e-4 against transformers
(as tests/model/test_hf_parity.py).
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.model import sharding
from jaxserve.model.loader import load_model
from tests.model.hf_tiny import hf_logits, make_tiny_model
from tests.model.paged_runner import PagedRunner

HEADS = dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
TP_TOL = 1e-5  # relative to max |logit|
HF_TOL = 1e-4


def _run(directory, tokens, mesh, scan_layers):
    config, graphdef, state = load_model(directory, "float32", scan_layers=scan_layers,
                                         mesh=mesh)
    runner = PagedRunner(config, graphdef, state, block_size=16, num_blocks=16, max_blocks=4,
                         mesh=mesh)
    out = [runner.step({"s": tokens[:30]}, all_logits=True)["s"]]
    out += [runner.step({"s": [t]})["s"][None] for t in tokens[30:]]
    return config, state, np.concatenate(out)


@pytest.mark.parametrize("arch, scan_layers", [
    ("LlamaForCausalLM", False), ("Qwen3ForCausalLM", True), ("Qwen2ForCausalLM", False)])
def test_tp_logits_match_one_device(arch, scan_layers, tmp_path):
    assert len(jax.devices()) >= 4
    hf_model = make_tiny_model(arch, tmp_path, **HEADS)
    tokens = np.random.default_rng(3).integers(0, 256, 40).tolist()
    expected = hf_logits(hf_model, tokens)
    _, _, one = _run(tmp_path, tokens, None, scan_layers)
    scale = max(1.0, float(np.abs(one).max()))
    for tp, kv_heads in ((2, 2), (4, 4)):  # TP = 4 > K = 2: each KV head on two devices
        mesh = sharding.make_mesh(tp)
        config, state, logits = _run(tmp_path, tokens, mesh, scan_layers)
        assert config.num_kv_heads == kv_heads
        err = float(np.abs(logits - one).max())
        assert err <= TP_TOL * scale, f"TP={tp}: max |Δlogit| {err} vs TP=1 (scale {scale})"
        assert np.abs(logits - expected).max() <= HF_TOL
        assert (logits.argmax(-1) == one.argmax(-1)).all()
        # Parameters really are split: each device holds 1/TP of a projection.
        layer = state["layers"] if scan_layers else state["layers"][0]
        qkv = layer["attn"]["qkv_proj"]
        assert qkv.sharding.spec[-2] == sharding.TP_AXIS  # [out, in]: split over outputs
        assert {s.data.shape[-2] for s in qkv.addressable_shards} == {qkv.shape[-2] // tp}
        assert layer["mlp"]["down_proj"].sharding.spec[-1] == sharding.TP_AXIS  # over inputs


def _config(**fields) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                intermediate_size=96, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=16,
                rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                tie_word_embeddings=True)
    return ModelConfig(**{**base, **fields})


def test_for_tensor_parallel_fits_or_refuses():
    demo_like = _config()  # 9 query heads, 3 KV heads, as the demo model
    assert demo_like.for_tensor_parallel(3) is demo_like
    with pytest.raises(ValueError, match="9 query heads do not split evenly over 2"):
        demo_like.for_tensor_parallel(2)
    grouped = _config(num_heads=16, num_kv_heads=4, intermediate_size=64)
    assert grouped.for_tensor_parallel(8).num_kv_heads == 8  # replicated
    assert sharding.kv_head_sources(grouped, 8) == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="MLP width 100"):
        _config(num_heads=8, num_kv_heads=8, intermediate_size=100).for_tensor_parallel(8)
    with pytest.raises(ValueError, match="6 KV heads neither split"):
        _config(num_heads=12, num_kv_heads=6, intermediate_size=48).for_tensor_parallel(4)


def test_fused_output_order_groups_parts_by_device():
    # q has 4 columns, k and v 2 each; two devices.
    order = sharding.fused_output_order((4, 2, 2), 2)
    assert order.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert sharding.fused_output_order((4, 2, 2), 1).tolist() == list(range(8))


def test_partition_specs():
    spec = sharding.param_partition_spec
    assert spec(("layers", 0, "attn", "qkv_proj"), 2, 256, 2) == P("tp", None)
    assert spec(("layers", "attn", "qkv_proj"), 3, 256, 2) == P(None, "tp", None)
    assert spec(("layers", 0, "attn", "qkv_bias"), 1, 256, 2) == P("tp")
    assert spec(("layers", 0, "mlp", "down_proj"), 2, 256, 2) == P(None, "tp")
    assert spec(("layers", 0, "attn", "q_norm", "weight"), 1, 256, 2) == P()
    assert spec(("embed",), 2, 256, 2) == P("tp", None)
    assert spec(("embed",), 2, 255, 2) == P()  # V not divisible: replicated
    assert spec(("lm_head",), 2, 256, 4) == P("tp", None)


def test_make_mesh_refuses_too_many_devices():
    assert sharding.make_mesh(1) is None
    with pytest.raises(ValueError, match="needs 64 devices"):
        sharding.make_mesh(64)
    with pytest.raises(ValueError, match=">= 1"):
        sharding.make_mesh(0)
