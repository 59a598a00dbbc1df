"""The model's ``pallas_interpret`` attention backend gives the ``reference`` backend's logits.

A tiny random-weight model (tests/model/hf_tiny.py: GQA 6 over 2 heads) runs
one mixed step (ragged prompts, padding tokens and rows) and one decode step
on a NaN-poisoned paged cache with each backend. Mistral adds the sliding
window. Bound: 5e-5 absolute on float32 logits of magnitude ~10, the model
tests' bound for two summation orders. The step computes the kernel's tile
schedule once and hands the same array to every layer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.kv_cache import init_kv_cache
from jaxserve.model.loader import load_model
from jaxserve.worker.inputs import StepLayout
from jaxserve.worker.model_runner import run_body_logits
from tests.model.hf_tiny import make_tiny_model
from tests.model.paged_runner import PagedRunner

TOL = 5e-5


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM"])
def test_pallas_interpret_backend_matches_reference(tmp_path, arch):
    make_tiny_model(arch, tmp_path, seed=4)
    config, graphdef, state = load_model(tmp_path, "float32")
    rng = np.random.default_rng(6)
    prompts = {f"p{i}": rng.integers(0, 256, n).tolist() for i, n in enumerate([1, 17, 30])}
    logits = {}
    for backend in ("reference", "pallas_interpret"):
        runner = PagedRunner(config, graphdef, state, block_size=16, num_blocks=16, max_blocks=4,
                             rows=5, backend=backend, seed=2)
        mixed = runner.step(prompts, pad_tokens=5, all_logits=True)
        decode = runner.step({name: [7] for name in prompts}, pad_tokens=2)
        logits[backend] = (mixed, decode)
    for step in (0, 1):
        for name in prompts:
            got, want = logits["pallas_interpret"][step][name], logits["reference"][step][name]
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want, atol=TOL, rtol=0, err_msg=f"{name} step {step}")


def test_every_layer_shares_the_step_tile_schedule(tmp_path):
    """The served body's jaxpr: each layer's attention call takes the one schedule."""
    make_tiny_model("LlamaForCausalLM", tmp_path, seed=4)
    config, graphdef, state = load_model(tmp_path, "float32")
    layout = StepLayout.for_bucket(16, 4, 16)
    kv_cache = init_kv_cache(config, 16, 16, jnp.float32)
    block_table, last_token = jnp.zeros((5, 4), jnp.int32), jnp.zeros(5, jnp.int32)
    buffer = jnp.zeros(layout.size, jnp.int32)
    jaxpr = jax.make_jaxpr(lambda *a: run_body_logits(graphdef, *a, layout=layout,
                                                      backend="pallas"))(
        state, kv_cache, block_table, last_token, buffer)
    tiles = []

    def walk(inner):
        for eqn in inner.eqns:
            if eqn.params.get("name") == "ragged_paged_attention":
                tiles.append(eqn.invars[-1])  # the last argument: tiles
            for value in eqn.params.values():
                sub = getattr(value, "jaxpr", value)
                if hasattr(sub, "eqns"):
                    walk(sub)

    walk(jaxpr.jaxpr)
    assert len(tiles) == config.num_layers
    assert len({id(v) for v in tiles}) == 1, "each layer computed its own schedule"
    assert tiles[0].aval.ndim == 2 and tiles[0].aval.shape[1] == 5  # i32[NT, 5], not qsl
