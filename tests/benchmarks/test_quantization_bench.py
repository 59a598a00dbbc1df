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
