"""No data-dependent control flow in any sampler variant, lowered for the GPU.

Each variant in SAMPLER_VARIANTS is lowered for the ``cuda`` platform from
shape specs (no GPU needed) and its StableHLO must hold no ``case``, ``if`` or
``while`` op. A sanity check first shows the helper does find the ops that
``lax.cond`` and ``lax.while_loop`` lower to, so the test cannot pass
vacuously.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.sampler import SAMPLER_VARIANTS, build_sampling_metadata, sample
from tests.hlo_checks import assert_no_control_flow, control_flow_ops, lower_for_cuda

ROWS, VOCAB = 8, 1000


def test_helper_finds_cond_and_while():
    x = jax.ShapeDtypeStruct((ROWS, VOCAB), jnp.float32)

    def with_cond(v):
        return lax.cond(jnp.any(v > 0), lambda a: a * 2, lambda a: a, v)

    def with_while(v):
        return lax.while_loop(lambda a: jnp.max(a) < 10, lambda a: a + 1, v)

    def with_fixed_loop(v):
        return lax.fori_loop(0, 4, lambda i, a: a + i, v, unroll=True)

    assert "stablehlo.case" in control_flow_ops(lower_for_cuda(with_cond, x))
    assert "stablehlo.while" in control_flow_ops(lower_for_cuda(with_while, x))
    for fn in (with_cond, with_while):
        with pytest.raises(AssertionError, match="control flow"):
            assert_no_control_flow(lower_for_cuda(fn, x))
    assert_no_control_flow(lower_for_cuda(with_fixed_loop, x))


def metadata_specs(logprobs_mode: str):
    md = build_sampling_metadata([SamplingParams()] * ROWS, prompt_token_ids=[[1]] * ROWS,
                                 output_token_ids=[[]] * ROWS, vocab_size=VOCAB,
                                 logprobs_mode=logprobs_mode)
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), md)


@pytest.mark.parametrize("logprobs_mode", ["raw", "processed"])
@pytest.mark.parametrize("variant", SAMPLER_VARIANTS, ids=lambda v: repr(v))
def test_variant_has_no_control_flow_on_gpu(variant, logprobs_mode):
    logits = jax.ShapeDtypeStruct((ROWS, VOCAB), jnp.float32)
    server_key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    text = lower_for_cuda(lambda x, m, k: sample(x, m, k, variant=variant), logits,
                          metadata_specs(logprobs_mode), server_key)
    assert "stablehlo.reduce" in text  # really the sampler
    assert_no_control_flow(text)


@pytest.mark.parametrize("variant", SAMPLER_VARIANTS, ids=lambda v: repr(v))
def test_variant_sorts_no_vocabulary_on_gpu(variant):
    """Every top_k lowered for the GPU fits XLA's TopK kernel (k <= 16): no sort of V.

    XLA's GPU backend sorts the whole row for lax.top_k with k > 16 (the 128
    candidates of the top-k/top-p filter, up to 20 logprobs): see
    jaxserve/worker/sampler/top_k.py.
    """
    import re

    from jaxserve.worker.sampler.top_k import GPU_TOP_K_KERNEL_MAX_K

    logits = jax.ShapeDtypeStruct((ROWS, VOCAB), jnp.float32)
    server_key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    text = lower_for_cuda(lambda x, m, k: sample(x, m, k, variant=variant), logits,
                          metadata_specs("raw"), server_key)
    ks = [int(k) for k in re.findall(r"top_k\(%[\w#]+, k = (\d+)\)", text)]
    assert "stablehlo.sort" not in text
    assert all(k <= GPU_TOP_K_KERNEL_MAX_K for k in ks), ks


def test_top_k_in_rounds_equals_lax_top_k():
    """The GPU path, run on the CPU, against lax.top_k and a NumPy stable sort (ties, -inf)."""
    from jaxserve.worker.sampler.top_k import exact_top_k, top_k_in_rounds

    rng = np.random.default_rng(0)
    x = rng.integers(-6, 6, size=(6, 300)).astype(np.float32)  # many ties
    x[1, 3:] = -np.inf  # only 3 finite values: the rest of the top 128 are -inf
    x[2, :] = -np.inf
    x[3] = rng.standard_normal(300).astype(np.float32)
    x[4, ::7] = -np.inf
    for k in (17, 20, 128, 300):
        want_v, want_i = lax.top_k(x, k)
        got_v, got_i = jax.jit(top_k_in_rounds, static_argnames="k")(x, k=k)
        np.testing.assert_array_equal(got_v, want_v)
        np.testing.assert_array_equal(got_i, want_i)
        order = np.lexsort((np.arange(300)[None, :].repeat(6, 0), -x), axis=1)[:, :k]
        np.testing.assert_array_equal(got_i, order)  # descending, lower index first on ties
        for fn in (exact_top_k, jax.jit(exact_top_k, static_argnames="k")):
            v, i = fn(x, k=k)
            np.testing.assert_array_equal(v, want_v)
            np.testing.assert_array_equal(i, want_i)
    with pytest.raises(ValueError, match="k must be in"):
        exact_top_k(x, 301)
