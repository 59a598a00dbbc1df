"""Logits parity with Hugging Face transformers (PyTorch, CPU, float32).

Each of the four architectures, tiny random weights (tests/model/hf_tiny.py),
through the paged cache: a 37-token prompt in one prefill step, then 10
single-token decode steps, with the layers unrolled and scanned
(``scan_layers``). Bound: max |Δlogit| <= 1e-4 (float32 round-off of
two independent implementations; observed ~3e-5).
"""

import numpy as np
import pytest

from jaxserve.model.loader import load_model
from tests.model.hf_tiny import ARCHS, hf_logits, make_tiny_model
from tests.model.paged_runner import PagedRunner

TOL = 1e-4


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_prefill_then_decode_matches_transformers(arch, scan_layers, tmp_path):
    hf_model = make_tiny_model(arch, tmp_path)
    config, graphdef, state = load_model(tmp_path, "float32", scan_layers=scan_layers)
    assert config.architecture == arch
    tokens = np.random.default_rng(7).integers(0, config.vocab_size, 47).tolist()
    expected = hf_logits(hf_model, tokens)  # [47, V]

    runner = PagedRunner(config, graphdef, state, block_size=16, num_blocks=16, max_blocks=4)
    prefill = runner.step({"seq": tokens[:37]}, all_logits=True)["seq"]
    errors = [np.abs(prefill - expected[:37]).max()]
    for i in range(37, 47):
        errors.append(np.abs(runner.step({"seq": [tokens[i]]})["seq"] - expected[i]).max())
    assert max(errors) <= TOL, f"{arch}: max |Δlogit| per step {errors}"
