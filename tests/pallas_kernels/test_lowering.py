"""Lowering for platform ``cuda`` without a GPU, and the kernel's cost estimate.

``jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))`` inside
``abstract_gpu()`` (``tests/hlo_checks.lower_for_cuda``) runs the Pallas Triton lowering (Triton IR built and serialised into the HLO custom
call) for every entry of the default tuning table, through both the split-K
(decode-shaped) and the single-pass (prefill-shaped) paths. Compiling that IR
for an H100 is the ``h100`` tier (test_h100_compile.py).
"""

import dataclasses

import jax
import pytest

from pallas_kernels.gpu_target import TRITON_CUSTOM_CALL
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.tuning import DEFAULT_TUNING, TuningConfig, num_kv_splits
from tests.hlo_checks import lower_for_cuda
from tests.pallas_kernels.shapes import (DEMO_DECODE, LLAMA3_8B_BATCH1_8K, LLAMA3_8B_DECODE_2K,
                                         LLAMA3_8B_DECODE_8K, LLAMA3_8B_PREFILL_8K, Problem,
                                         table_problems)

def _attention(problem: Problem):
    scale = problem.head_dim ** -0.5
    return jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale))


def pallas_calls(problem: Problem) -> list:
    """The pallas_call equations of one call's jaxpr (searched through nested jaxprs)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(eqn)
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(_attention(problem))(*problem.specs()).jaxpr)
    return found


def _splits(problem: Problem) -> int:
    tuning = DEFAULT_TUNING[(problem.head_dim, problem.block_size, problem.dtype)]
    return num_kv_splits(tuning, num_tokens=problem.num_tokens, num_rows=problem.num_rows,
                         num_kv_heads=problem.num_kv_heads,
                         max_context=problem.max_blocks * problem.block_size)


@pytest.mark.parametrize("key", sorted(DEFAULT_TUNING), ids=lambda k: f"H{k[0]}-S{k[1]}-{k[2]}")
def test_default_table_lowers_for_cuda(key):
    for shape, problem in table_problems(*key).items():
        assert (_splits(problem) > 1) == (shape == "decode"), shape
        text = lower_for_cuda(_attention(problem), *problem.specs())
        assert text.count(TRITON_CUSTOM_CALL) == 1, shape


@pytest.mark.parametrize("key", sorted(DEFAULT_TUNING), ids=lambda k: f"H{k[0]}-S{k[1]}-{k[2]}")
def test_decode_and_prefill_launch_their_own_tiles(key):
    """A decode-shaped call launches the entry's decode key tile, warps and stages; a
    prefill-shaped call its prefill ones (read off the pallas_call itself)."""
    tuning = DEFAULT_TUNING[key]
    for shape, problem in table_problems(*key).items():
        launch = tuning.launch(problem.num_tokens)
        assert launch.decode_shaped == (shape == "decode")
        want = ((tuning.decode_block_kv, tuning.decode_num_warps, tuning.decode_num_stages)
                if shape == "decode" else (tuning.block_kv, tuning.num_warps, tuning.num_stages))
        assert (launch.block_kv, launch.num_warps, launch.num_stages) == want
        (call,) = pallas_calls(problem)
        params = call.params["compiler_params"]
        assert f"_kv{launch.block_kv}_" in str(call.params["name"])
        assert (params.num_warps, params.num_stages) == (launch.num_warps, launch.num_stages)


def test_decode_launch_falls_back_to_prefill_values():
    tuning = TuningConfig(block_kv=32, num_warps=8, num_stages=2, decode_num_stages=3)
    decode, prefill = tuning.launch(1), tuning.launch(tuning.decode_max_tokens + 1)
    assert (decode.block_m, decode.block_kv, decode.num_warps, decode.num_stages) == (16, 32, 8, 3)
    assert (prefill.block_m, prefill.block_kv, prefill.num_warps,
            prefill.num_stages) == (64, 32, 8, 2)
    with pytest.raises(ValueError, match="decode_block_kv"):
        TuningConfig(decode_block_kv=24)
    with pytest.raises(ValueError, match="decode_num_warps"):
        TuningConfig(decode_num_warps=3)
    with pytest.raises(ValueError, match="decode_num_stages"):
        TuningConfig(decode_num_stages=0)
    with pytest.raises(ValueError, match="^num_stages"):
        TuningConfig(num_stages=0)
    with pytest.raises(ValueError, match="k_splits"):
        TuningConfig(k_splits=-1)
    with pytest.raises(ValueError, match="decode_max_tokens"):
        TuningConfig(decode_max_tokens=-1)


@pytest.mark.parametrize("problem", [LLAMA3_8B_DECODE_8K, LLAMA3_8B_PREFILL_8K,
                                     LLAMA3_8B_BATCH1_8K, DEMO_DECODE],
                         ids=["llama3_8b_decode_8k", "llama3_8b_prefill_8k", "llama3_8b_batch1_8k",
                              "demo_decode"])
def test_model_shapes_lower_for_cuda(problem):
    text = lower_for_cuda(_attention(problem), *problem.specs())
    assert text.count(TRITON_CUSTOM_CALL) == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dims_not_a_power_of_two_lower_for_cuda(head_dim, dtype):
    """H = 80 / 96 lowers through both paths in 128-column tiles (the H = 128 entry's launch)."""
    for shape, problem in table_problems(head_dim, 16, dtype).items():
        text = lower_for_cuda(_attention(problem), *problem.specs())
        assert text.count(TRITON_CUSTOM_CALL) == 1, shape
        (call,) = pallas_calls(problem)
        want = DEFAULT_TUNING[(128, 16, dtype)].launch(problem.num_tokens)
        assert f"_kv{want.block_kv}_" in str(call.params["name"]), (shape, call.params["name"])


def test_every_pallas_call_has_a_cost_estimate():
    for problem in (*table_problems(64, 16, "float32").values(), DEMO_DECODE):
        calls = pallas_calls(problem)
        assert len(calls) == 1
        cost = calls[0].params["cost_estimate"]
        assert cost is not None and cost.bytes_accessed > 0 and cost.flops > 0


def test_llama3_decode_cost_estimate_matches_kv_bytes():
    """Llama-3-8B decode, 256 rows at 2k context: the estimate is the K/V read plus little.

    K/V that must be read: 2 x 256 rows x 2048 tokens x 8 KV heads x 128 x 2 bytes
    = 2 GiB; the estimate adds q, the output and the block table (< 1 %).
    """
    problem = LLAMA3_8B_DECODE_2K
    assert _splits(problem) == 1  # 256 rows x 8 KV heads already fill 132 SMs
    (call,) = pallas_calls(problem)
    kv_bytes = problem.kv_bytes_at_full_context()
    assert kv_bytes == 2 * 256 * 2048 * 8 * 128 * 2
    ratio = call.params["cost_estimate"].bytes_accessed / kv_bytes
    assert 1.0 < ratio < 1.01, ratio


@pytest.mark.parametrize("problem", [LLAMA3_8B_DECODE_8K, LLAMA3_8B_PREFILL_8K, DEMO_DECODE],
                         ids=["llama3_8b_decode_8k", "llama3_8b_prefill_8k", "demo_decode"])
def test_fp8_cache_lowers_for_cuda(problem):
    """An fp8 (e4m3) cache under bfloat16 queries: one Triton call, whose estimate counts
    the cache at 1 byte an element."""
    fp8 = dataclasses.replace(problem, kv_dtype="float8_e4m3fn")
    text = lower_for_cuda(_attention(fp8), *fp8.specs())
    assert text.count(TRITON_CUSTOM_CALL) == 1
    (call,) = pallas_calls(fp8)
    (wide,) = pallas_calls(problem)
    saved = wide.params["cost_estimate"].bytes_accessed - call.params["cost_estimate"].bytes_accessed
    assert saved == fp8.kv_bytes_at_full_context(), saved  # half of bfloat16's K/V bytes
