"""Every executable of the served step, lowered for the GPU, has no data-dependent control flow.

The whole ladder (bodies with the Pallas attention backend, the LM head +
sampler in every variant, the staged row writes) is lowered for platform
``cuda`` with no GPU present; the StableHLO must hold no ``case`` / ``if`` /
``while`` (``tests/hlo_checks.py``), since a GPU runs each by copying its
predicate to the host and waiting. The CPU reference attention keeps its
loops (a conditional costs no device sync on the CPU) and is not lowered here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxserve.model.kv_cache import kv_cache_shapes
from jaxserve.model.loader import load_model
from jaxserve.worker.executables import LadderShapes, ladder_executables
from jaxserve.worker.rows import RowState
from jaxserve.worker.sampler import SAMPLER_VARIANTS
from tests.hlo_checks import assert_no_control_flow, lower_for_cuda
from tests.model.hf_tiny import make_tiny_model


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model("LlamaForCausalLM", directory)
    config, graphdef, state = load_model(directory, "bfloat16")
    kv = kv_cache_shapes(config, 32, 16, jnp.bfloat16)
    rows = RowState(8, 256, 16, config.vocab_size, config.eos_token_ids)
    hidden = jax.ShapeDtypeStruct((8, config.hidden_size), jnp.bfloat16)
    shapes = LadderShapes(graphdef, state, kv, rows, hidden, "pallas")
    return ladder_executables(shapes, token_buckets=(1, 16, 64), request_buckets=(1, 8))


def _lower_for_cuda(exe) -> str:
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), exe.args)
    return lower_for_cuda(exe.fn, *specs, donate_argnums=exe.donate)


def test_the_ladder_covers_every_kind_and_variant(ladder):
    names = [exe.name for exe in ladder]
    assert sum(n.startswith("body[") for n in names) == 3
    assert sum(n.startswith("sampler[") for n in names) == 2 * len(SAMPLER_VARIANTS)
    assert {exe.kind for exe in ladder} == {"body", "sampler", "rows"}


def test_no_executable_of_the_step_has_control_flow(ladder):
    for exe in ladder:
        text = _lower_for_cuda(exe)
        if exe.kind == "body":
            assert "custom_call @__gpu$xla.gpu.triton" in text, (
                f"{exe.name}: the Pallas kernel was not lowered")
        try:
            assert_no_control_flow(text)
        except AssertionError as err:
            raise AssertionError(f"{exe.name}: {err}") from None
