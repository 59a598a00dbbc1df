"""Every executable of the served step, lowered for the GPU, has no data-dependent control flow.

The whole ladder (bodies with the Pallas attention backend, the LM head +
sampler in every variant, the prompt logprobs, the staged row writes) is lowered for platform
``cuda`` with no GPU present; the StableHLO must hold no ``case`` / ``if`` /
``while`` (``tests/hlo_checks.py``), since a GPU runs each by copying its
predicate to the host and waiting. The CPU reference attention keeps its
loops (a conditional costs no device sync on the CPU) and is not lowered here.
"""

from __future__ import annotations

import jax
import pytest

from jaxserve.worker.sampler import COMPILED_VARIANTS
from tests.hlo_checks import assert_no_control_flow, lower_for_cuda
from tests.worker.tiny_ladder import tiny_pallas_ladder


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    return tiny_pallas_ladder(tmp_path_factory.mktemp("tiny_llama"), token_buckets=(1, 16, 64),
                              request_buckets=(1, 8))


def _lower_for_cuda(exe) -> str:
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), exe.args)
    return lower_for_cuda(exe.fn, *specs, donate_argnums=exe.donate)


def test_the_ladder_covers_every_kind_and_variant(ladder):
    names = [exe.name for exe in ladder]
    assert sum(n.startswith("body[") for n in names) == 3
    assert sum(n.startswith("sampler[") for n in names) == 2 * len(COMPILED_VARIANTS)
    assert sum(n.startswith("prompt_logprobs[") for n in names) == 3
    assert {exe.kind for exe in ladder} == {"body", "sampler", "prompt_logprobs", "rows"}


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
