"""KV cache sizing: explicit settings, the CPU budget, and device memory minus activations.

Oracles: the arithmetic of the rule (limit x utilization - in use -
activations) // bytes per block; ``kv_cache_bytes_per_block`` recomputed
from the config (2 L K S H itemsize); and, for ``memory_analysis``, a
function whose temporaries have a known lower bound. The automatic path of
a GPU is exercised on CPU by reporting a device memory to the worker.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.loader import load_model
from jaxserve.step_plan import WorkerInit
from jaxserve.worker import InProcessWorker, in_process
from jaxserve.worker.executables import (LadderShapes, lower_body, lower_sampler,
                                         prompt_logprobs_executable)
from jaxserve.worker.kv_sizing import (DEFAULT_CPU_KV_CACHE_BYTES, DeviceMemory,
                                       HEADROOM_FRACTION, blocks_from_free_memory,
                                       num_kv_blocks, peak_activation_bytes)
from tests.model.hf_tiny import make_tiny_model

MiB = 1 << 20


def test_explicit_settings_take_precedence_and_cpu_has_a_budget():
    kw = dict(bytes_per_block=3 * MiB, utilization=0.9,
              activation_bytes=lambda: pytest.fail("must not compile"))
    memory = DeviceMemory(80 << 30, 1 << 30)
    assert num_kv_blocks(num_blocks=7, kv_cache_bytes=1 << 40, memory=memory, **kw) == 7
    assert num_kv_blocks(num_blocks=None, kv_cache_bytes=100 * MiB, memory=memory, **kw) == 33
    assert num_kv_blocks(num_blocks=None, kv_cache_bytes=None, memory=None,
                         **kw) == DEFAULT_CPU_KV_CACHE_BYTES // (3 * MiB)


def test_a_kv_cache_budget_below_two_blocks_says_how_many_bytes_it_needs():
    kw = dict(num_blocks=None, bytes_per_block=3 * MiB, memory=None, utilization=0.9)
    assert num_kv_blocks(kv_cache_bytes=6 * MiB, **kw) == 2
    with pytest.raises(ValueError) as err:
        num_kv_blocks(kv_cache_bytes=6 * MiB - 1, **kw)
    assert (f"holds 1 of the 2 blocks" in str(err.value) and "--kv-cache-bytes" in str(err.value)
            and f"at least {6 * MiB}" in str(err.value))


def test_free_memory_rule():
    memory = DeviceMemory(bytes_limit=1000 * MiB, bytes_in_use=300 * MiB)
    # 1000 * 0.8 - 300 - 100 - 2 % of 800 (16) = 384 MiB -> 384 // 3 = 128 blocks of 3 MiB.
    assert HEADROOM_FRACTION == 0.02
    assert blocks_from_free_memory(memory, 100 * MiB, 0.8, 3 * MiB) == 128
    assert num_kv_blocks(num_blocks=None, kv_cache_bytes=None, bytes_per_block=3 * MiB,
                         memory=memory, utilization=0.8,
                         activation_bytes=lambda: 100 * MiB) == 128
    with pytest.raises(ValueError, match="no room for a KV cache"):
        blocks_from_free_memory(memory, 495 * MiB, 0.8, 3 * MiB)
    with pytest.raises(ValueError, match="memory_utilization"):
        blocks_from_free_memory(memory, 0, 1.5, 3 * MiB)


def test_peak_activation_bytes_reads_the_compilers_temporaries():
    n = 512

    def sorted_gram(x):  # the sorted [n, n] product is a temporary of n * n * 4 bytes
        return jnp.sort(x @ x.T, axis=1)[:, -1]

    small = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((n, 8), np.float32)).compile()
    big = jax.jit(sorted_gram).lower(jax.ShapeDtypeStruct((n, 8), np.float32)).compile()
    peak = peak_activation_bytes([small, big])
    assert n * n * 4 <= peak < 4 * n * n * 4
    # held at once (a body beside the previous step's sampler): the sum, not the max
    assert peak == peak_activation_bytes([small]) + peak_activation_bytes([big])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_kv")
    make_tiny_model("LlamaForCausalLM", directory, seed=2)
    return load_model(directory, "float32")


@pytest.mark.parametrize("precompile", [False, True])
def test_worker_sizes_its_cache_from_reported_device_memory(tiny, monkeypatch, precompile):
    config = tiny[0]
    memory = DeviceMemory(bytes_limit=256 * MiB, bytes_in_use=40 * MiB)
    monkeypatch.setattr(in_process, "device_memory", lambda device: memory)
    init = WorkerInit(model=None, dtype="float32", block_size=8, num_kv_blocks=None,
                      kv_cache_bytes=None, max_num_seqs=4, max_model_len=128,
                      token_buckets=(1, 8, 32), request_buckets=(1, 4), memory_utilization=0.5,
                      precompile=precompile)
    worker = InProcessWorker(tiny, progress=False)
    geometry = worker.initialize(init)
    per_block = 2 * config.num_layers * config.num_kv_heads * 8 * config.head_dim * 4
    # The activations of the largest buckets, from the same lowerings, compiled here again.
    kv = worker._kv_spec(2, jnp.float32)
    hidden = jax.ShapeDtypeStruct((4, config.hidden_size), jnp.float32)
    shapes = LadderShapes(worker.graphdef, worker.state, kv, worker.rows, hidden, worker.backend)
    activations = peak_activation_bytes([lower_body(shapes, 32).compile(),
                                         prompt_logprobs_executable(shapes, 32).lower().compile(),
                                         lower_sampler(shapes, 4).compile()])
    assert activations > 0
    budget = int(256 * MiB * 0.5)
    want = (budget - 40 * MiB - activations - int(budget * HEADROOM_FRACTION)) // per_block
    assert geometry.num_kv_blocks == want
    assert worker.kv_cache.num_blocks == want
    if precompile:  # the sizing body is the one extra compile; the ladder's sampler and
        # its largest prompt-logprob executable (moved before ready) are reused
        report = worker.compile_report
        assert report.by_kind == {"sizing": 1, "body": 3, "sampler": 2 * 2, "rows": 2 + 1,
                                  "prompt_logprobs": 1}
        assert report.num_backend_compiles == report.num_executables


def test_a_cache_too_small_for_one_sequence_is_refused_before_the_bodies_compile(tiny,
                                                                                 monkeypatch):
    """3 blocks of 8 hold 16 tokens, not max_model_len=128: the worker says so once the
    cache is sized, and compiles no model body first (they take most of a start-up)."""
    kinds = []
    compile_all = in_process.compile_all

    def recording(executables, **kw):
        kinds.extend(e.kind for e in executables)
        return compile_all(executables, **kw)

    monkeypatch.setattr(in_process, "compile_all", recording)
    init = WorkerInit(model=None, dtype="float32", block_size=8, num_kv_blocks=3,
                      kv_cache_bytes=None, max_num_seqs=4, max_model_len=128,
                      token_buckets=(1, 8, 32), request_buckets=(1, 4), precompile=True)
    with pytest.raises(ValueError) as err:
        InProcessWorker(tiny, progress=False).initialize(init)
    assert str(err.value).startswith("the KV cache holds 16 tokens (2 usable block(s) of 8), "
                                     "fewer than max_model_len=128")
    assert "--num-kv-blocks" in str(err.value)
    assert kinds and "body" not in kinds  # the samplers and row writes did compile


def test_utilization_is_a_fraction_of_total_device_memory(monkeypatch):
    """As vLLM's --gpu-memory-utilization: of the GPU's total, capped by JAX's pool."""
    import types

    from jaxserve.worker.kv_sizing import device_memory

    def gpu(limit):
        return types.SimpleNamespace(platform="gpu", memory_stats=lambda: {
            "bytes_limit": limit, "bytes_in_use": 0})

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert device_memory([gpu(750 * MiB)]).total == 1000 * MiB  # JAX's default pool: 75 %
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert device_memory([gpu(900 * MiB)]).total == 1000 * MiB
    tpu = types.SimpleNamespace(platform="tpu", memory_stats=lambda: {"bytes_limit": 16 * MiB})
    assert device_memory([tpu]).total == 16 * MiB
    # Pool = 0.9 of 1000: 1000 * 0.9 - 300 - 100 - 18 (headroom) = 482 MiB -> 160 blocks.
    memory = DeviceMemory(bytes_limit=900 * MiB, bytes_in_use=300 * MiB, total_bytes=1000 * MiB)
    assert blocks_from_free_memory(memory, 100 * MiB, 0.9, 3 * MiB) == 160
    # JAX's default 75 % pool caps it: 750 - 300 - 100 - 15 = 335 MiB -> 111 blocks.
    memory = DeviceMemory(bytes_limit=750 * MiB, bytes_in_use=300 * MiB, total_bytes=1000 * MiB)
    assert blocks_from_free_memory(memory, 100 * MiB, 0.9, 3 * MiB) == 111


def test_a_gpu_without_memory_stats_is_an_error_not_the_cpu_budget():
    kw = dict(num_blocks=None, kv_cache_bytes=None, bytes_per_block=3 * MiB, memory=None,
              utilization=0.9)
    with pytest.raises(ValueError, match="gpu device reports no memory statistics"):
        num_kv_blocks(**kw, platform="gpu")
    assert num_kv_blocks(**kw, platform="cpu") == DEFAULT_CPU_KV_CACHE_BYTES // (3 * MiB)
    assert num_kv_blocks(**{**kw, "kv_cache_bytes": 30 * MiB}, platform="gpu") == 10
