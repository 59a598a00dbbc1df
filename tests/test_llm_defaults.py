"""``jaxserve.LLM``'s default compilation cache: the server's, unless JAX already has one."""

from __future__ import annotations

import sys

from jaxserve import llm


def test_default_cache_is_the_servers_when_jax_has_none(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "jax", None)  # as if jax were not imported yet
    assert llm._default_compilation_cache_dir() == str(tmp_path / "jax_cache")


def test_an_explicit_jax_cache_directory_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert llm._default_compilation_cache_dir() is None
