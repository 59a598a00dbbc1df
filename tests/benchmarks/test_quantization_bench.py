"""``benchmarks.quantization.perplexity`` against transformers' own loss on the same tokens."""

from __future__ import annotations

import math

import numpy as np
import torch

from benchmarks.quantization import perplexity
from jaxserve.model.loader import load_model
from tests.model.hf_tiny import make_tiny_model


def test_perplexity_is_exp_of_transformers_mean_loss(tmp_path):
    hf = make_tiny_model("LlamaForCausalLM", tmp_path, initializer_range=0.02)
    tokens = np.random.default_rng(4).integers(0, 256, 37).tolist()  # 3 blocks, the last partial
    with torch.no_grad():
        loss = hf(torch.tensor([tokens]), labels=torch.tensor([tokens])).loss.item()
    # float32 logits of a 2-layer model: the mean NLL agrees to ~1e-5
    assert math.isclose(perplexity(load_model(tmp_path), tokens), math.exp(loss), rel_tol=1e-4)
    # int8 weights move it a little, not a lot (the benchmark's delta)
    int8 = perplexity(load_model(tmp_path, quantization="int8"), tokens)
    assert math.isclose(int8, math.exp(loss), rel_tol=1e-2)
    # int4 more (|Δ mean NLL| <= 0.0063 nats measured on such models: test_quantized_model.py)
    int4 = perplexity(load_model(tmp_path, quantization="int4"), tokens)
    assert math.isclose(int4, math.exp(loss), rel_tol=3e-2)



def test_fp8_quality_fake_path_is_the_served_fp8_maths(tmp_path):
    """``benchmarks.fp8_quality``'s counterfactuals on a 2-layer model: fake W8A8 computes what
    the served fp8 path does (the same e4m3 values, a float32 product instead of the fp8 dot)
    — its logits on average 10x closer to the served fp8 ones than the float model's are
    (measured 3e-4 against 9e-3: a few e4m3 roundings flip between the two, as on the demo
    model) — fake weights only what the float model with the loader's e4m3 kernels
    dequantized does (1e-5 against 6e-3: in-trace quantization breaks a few ties the other
    way), selecting nothing the float model; the nudge moves float32 by round-off only."""
    import jax

    from benchmarks.fp8_quality import draws, fake_quantized_linear
    from benchmarks.quantization import text_logits
    from jaxserve.model import quantization as quant

    make_tiny_model("LlamaForCausalLM", tmp_path, initializer_range=0.02)
    tokens = np.random.default_rng(5).integers(0, 256, 37).tolist()
    f32, fp8 = load_model(tmp_path), load_model(tmp_path, quantization="fp8")
    base = draws(f32, tokens, 2)
    assert base["std"] < 1e-5 * base["mean"]
    assert draws(f32, tokens, 1, {"select": lambda layer, kind: False})["mean"] == base["draws"][0]
    jax.clear_caches()
    float_logits, served = text_logits(f32, tokens), text_logits(fp8, tokens)
    jax.clear_caches()
    with fake_quantized_linear(f32[0].num_layers):
        fake = text_logits(f32, tokens)
    jax.clear_caches()
    with fake_quantized_linear(f32[0].num_layers, activations=False):
        weights_only = text_logits(f32, tokens)
    jax.clear_caches()
    off, quant_err = np.abs(fake - served).mean(), np.abs(float_logits - served).mean()
    assert off <= 0.1 * quant_err, (off, quant_err)
    state = fp8[2]
    deq = {**f32[2], "layers": {
        i: {**layer, **{part: {k: quant.dequantize(v, layer[part][k + quant.SCALE_SUFFIX])
                               for k, v in layer[part].items()
                               if k + quant.SCALE_SUFFIX in layer[part]}
                        for part in ("attn", "mlp")}}
        for i, layer in state["layers"].items()}}
    want = text_logits((f32[0], f32[1], deq), tokens)
    assert np.abs(weights_only - want).mean() <= 0.01 * np.abs(float_logits - want).mean()
