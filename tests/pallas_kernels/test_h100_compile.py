"""Deviceless compile for an H100 (marker ``h100``; run with scripts/h100_compile_env.sh).

Needs the CUDA plugin (jax-cuda12-plugin / jax-cuda12-pjrt of jax's version,
or the cuda13 pair), ``JAX_PLATFORMS=cpu`` and ptxas: lowered inside
``abstract_gpu()`` (the Pallas Triton lowering asks which GPU it targets), XLA
then compiles the Triton kernels to cubins for a topology built from
pallas_kernels/h100_target_config.pbtxt,
which also checks each kernel's shared memory against the H100's opt-in
limit. Skipped when the plugin is absent (the default environment).

Each compile dumps XLA's thunk sequence, from which the kernel's launch grid,
threads and shared memory are read and printed (``pytest -s``). The served
step of a Llama-3-8B-shaped model (all 32 layers, full widths and
vocabulary, abstract bfloat16 weights) is compiled too: its thunk sequence
must hold no ``kWhile`` / ``kConditional`` (each would make the GPU wait on
the host) and every kernel's shared memory must fit the H100.
"""

import dataclasses
import importlib.util
import os
import pathlib
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.gpu_target import abstract_gpu
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.tuning import DEFAULT_TUNING, TuningConfig
from tests.pallas_kernels.shapes import (DEMO_DECODE, LLAMA3_8B_BATCH1_8K, LLAMA3_8B_DECODE_2K,
                                         LLAMA3_8B_DECODE_8K, LLAMA3_8B_PREFILL_8K, Problem,
                                         table_problems)

if not any(importlib.util.find_spec(f"jax_plugins.xla_cuda{major}") is not None
           for major in (12, 13) if importlib.util.find_spec("jax_plugins") is not None):
    pytest.skip("CUDA plugin absent: scripts/h100_compile_env.sh", allow_module_level=True)
pytestmark = pytest.mark.h100

TARGET_CONFIG = pathlib.Path(__file__).parents[2] / "pallas_kernels" / "h100_target_config.pbtxt"
_THUNK = re.compile(r"(\S+) grid: \[([^\]]*)\] threads: \[([^\]]*)\]\s+shared_memory: (\d+) bytes")


def _smem_limit() -> int:
    text = TARGET_CONFIG.read_text()
    return int(re.search(r"shared_memory_per_block_optin: (\d+)", text).group(1))


@pytest.fixture(scope="module")
def h100():
    """A sharding on one device of an H100 topology (no GPU needed)."""
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        pytest.skip("the deviceless compile needs JAX_PLATFORMS=cpu")
    from jax.experimental import topologies  # noqa: PLC0415

    # A persistent-cache hit would skip the compile (and its dump) we check.
    jax.config.update("jax_enable_compilation_cache", False)
    topology = topologies.get_topology_desc("h100", "cuda", target_config=TARGET_CONFIG.read_text(),
                                            topology="1x1x1")
    return jax.sharding.SingleDeviceSharding(topology.devices[0])


def thunk_sequences(jitted, specs) -> str:
    """Compiles ``jitted`` at ``specs`` (H100-sharded); returns XLA's thunk-sequence dumps."""
    with tempfile.TemporaryDirectory() as dump, abstract_gpu():
        lowered = jitted.trace(*specs).lower(lowering_platforms=("cuda",))
        lowered.compile(compiler_options={"xla_dump_to": dump})
        return "\n".join(p.read_text() for p in pathlib.Path(dump).glob("*thunk_sequence*"))


def compile_for_h100(problem: Problem, sharding, tuning: TuningConfig | None = None) -> dict:
    """Compiles one call; returns the attention kernel's {name, grid, threads, smem}."""
    scale = problem.head_dim ** -0.5
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale, tuning=tuning))
    thunks = _THUNK.findall(thunk_sequences(fn, problem.specs(sharding)))
    kernels = {(name, grid, threads, int(smem)) for name, grid, threads, smem in thunks
               if name.startswith("ragged_paged_attention")}
    assert len(kernels) == 1, thunks
    name, grid, threads, smem = kernels.pop()
    print(f"\nH100 compile ok: {problem} -> {name} grid [{grid}] threads [{threads}] "
          f"shared memory {smem} B")
    return {"name": name, "grid": grid, "threads": threads, "smem": smem}


@pytest.mark.parametrize("key", sorted(DEFAULT_TUNING), ids=lambda k: f"H{k[0]}-S{k[1]}-{k[2]}")
def test_default_table_compiles_for_h100(h100, key):
    for shape, problem in table_problems(*key).items():
        kernel = compile_for_h100(problem, h100)
        assert 0 < kernel["smem"] <= _smem_limit(), (shape, kernel)
        assert kernel["name"].endswith("_s1") == (shape == "prefill"), kernel


@pytest.mark.parametrize("problem", [LLAMA3_8B_DECODE_8K, LLAMA3_8B_DECODE_2K,
                                     LLAMA3_8B_PREFILL_8K, LLAMA3_8B_BATCH1_8K, DEMO_DECODE],
                         ids=["llama3_8b_decode_8k", "llama3_8b_decode_2k",
                              "llama3_8b_prefill_8k", "llama3_8b_batch1_8k", "demo_decode"])
def test_model_shapes_compile_for_h100(h100, problem):
    kernel = compile_for_h100(problem, h100)
    assert 0 < kernel["smem"] <= _smem_limit()


@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dims_not_a_power_of_two_compile_for_h100(h100, head_dim):
    """H = 80 / 96 compile in 128-column tiles: the same shared memory as H = 128."""
    for shape, problem in table_problems(head_dim, 16, "bfloat16").items():
        kernel = compile_for_h100(problem, h100)
        padded = compile_for_h100(table_problems(128, 16, "bfloat16")[shape], h100)
        assert kernel["smem"] == padded["smem"] <= _smem_limit(), (shape, kernel, padded)


def test_shared_memory_overflow_is_caught(h100):
    """The tier is a real check: tiles too big for shared memory fail to compile."""
    problem = table_problems(256, 16, "float32")["prefill"]
    huge = TuningConfig(block_m=128, block_kv=128, num_warps=8, num_stages=4)
    with pytest.raises(Exception, match="[Ss]hared memory"):
        compile_for_h100(problem, h100, huge)


@pytest.fixture(scope="module")
def llama3_8b_ladder():
    """Body and sampler executables of a Llama-3-8B-shaped model: M = 256, 8k context."""
    from benchmarks.llama8b_decode import llama3_8b  # noqa: PLC0415
    from jaxserve.model.kv_cache import kv_cache_shapes  # noqa: PLC0415
    from jaxserve.model.loader import abstract_model  # noqa: PLC0415
    from jaxserve.worker.executables import LadderShapes, ladder_executables  # noqa: PLC0415
    from jaxserve.worker.rows import RowState  # noqa: PLC0415

    config = llama3_8b()
    graphdef, state = abstract_model(config, jnp.bfloat16)
    kv = kv_cache_shapes(config, 4096, 16, jnp.bfloat16)
    rows = RowState(256, 8192, 16, config.vocab_size, config.eos_token_ids)
    hidden = jax.ShapeDtypeStruct((256, config.hidden_size), jnp.bfloat16)
    shapes = LadderShapes(graphdef, state, kv, rows, hidden, "pallas")
    ladder = ladder_executables(shapes, token_buckets=(1, 256, 2048), request_buckets=(256,))
    wanted = {"body[T=1]", "body[T=256]", "body[T=2048]"}
    exes = [exe for exe in ladder if exe.name in wanted or exe.kind == "sampler"]
    return [exes[i] for i in (0, 1, 2, len(exes) - 1)]  # the bodies, the fullest sampler


@pytest.mark.parametrize("index", [0, 1, 2, 3], ids=["body_T1", "body_T256", "body_T2048",
                                                    "sampler_R256"])
def test_llama3_8b_served_step_compiles_for_h100(h100, llama3_8b_ladder, index):
    exe = llama3_8b_ladder[index]
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h100),
                         exe.args)
    start = time.perf_counter()
    text = thunk_sequences(jax.jit(exe.fn, donate_argnums=exe.donate), specs)
    seconds = time.perf_counter() - start
    assert "kWhile" not in text and "kConditional" not in text, exe.name
    kernels = _THUNK.findall(text)
    attention = {(k[0], k[1]) for k in kernels if k[0].startswith("ragged_paged_attention")}
    assert bool(attention) == (exe.kind == "body"), (exe.name, attention)
    if exe.name == "body[T=1]":  # batch-1 decode at 8k: 1 tile x 8 KV heads x 33 splits
        assert {grid for _, grid in attention} == {"1, 8, 33"}, attention
    worst = max(int(k[3]) for k in kernels)
    assert worst <= _smem_limit(), (exe.name, worst)
    print(f"\nH100 compile ok: {exe.name} in {seconds:.1f} s, {len(kernels)} kernels, "
          f"most shared memory {worst} B; attention: {sorted(set(attention))}")


@pytest.mark.parametrize("problem", [LLAMA3_8B_DECODE_8K, LLAMA3_8B_PREFILL_8K,
                                     LLAMA3_8B_BATCH1_8K],
                         ids=["llama3_8b_decode_8k", "llama3_8b_prefill_8k", "llama3_8b_batch1_8k"])
def test_fp8_cache_compiles_for_h100(h100, problem):
    """An fp8 (e4m3) cache under bfloat16 queries compiles for sm_90 (Triton widens the
    e4m3 tiles to bfloat16) with the bfloat16 cache's launch grid, within shared memory."""
    kernel = compile_for_h100(dataclasses.replace(problem, kv_dtype="float8_e4m3fn"), h100)
    wide = compile_for_h100(problem, h100)
    assert kernel["grid"] == wide["grid"] and kernel["name"] == wide["name"], (kernel, wide)
    assert 0 < kernel["smem"] <= _smem_limit(), kernel
