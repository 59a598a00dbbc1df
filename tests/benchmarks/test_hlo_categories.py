"""HLO op categories on real compiled modules: the tiny Llama's step, and named scopes."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.hlo_categories import categorize, categorize_by_name, parse


def _entry_categories(text: str) -> collections.Counter:
    name, computations, _, _ = parse(text)
    entry = next(c for c in computations if c.startswith("main"))
    return collections.Counter(categorize(i, computations, name) for i in computations[entry]
                               if i.opcode not in ("parameter", "constant", "tuple",
                                                   "get-tuple-element"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from jaxserve.model.loader import load_model
    from tests.model.hf_tiny import make_tiny_model

    directory = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model("LlamaForCausalLM", directory)
    return load_model(str(directory), "float32")


def test_tiny_llama_step(tiny_model):
    """The served body executable: each layer's 4 projections are the matmuls; writes and
    attention found; T read from the executable's name."""
    from jaxserve.model.kv_cache import init_kv_cache
    from jaxserve.worker.compile_manager import compile_all
    from jaxserve.worker.executables import LadderShapes, body_executable
    from jaxserve.worker.rows import RowState

    config, graphdef, state = tiny_model
    t, block_size = 8, 4
    kv = init_kv_cache(config, 16, block_size, jnp.float32)
    rows = RowState(4, 64, block_size, config.vocab_size, config.eos_token_ids)
    hidden = jax.ShapeDtypeStruct((4, config.hidden_size), jnp.float32)
    shapes = LadderShapes(graphdef, state, kv, rows, hidden, "reference")
    report = compile_all([body_executable(shapes, t)], progress=False)
    text = report.functions[f"body[T={t}]"].compiled.as_text()
    name, _, _, num_tokens = parse(text)
    assert name == "jit_body_T8" and num_tokens == t  # T from the executable's name
    counts = _entry_categories(text)
    layers = config.num_layers
    assert counts["matmul"] == 4 * layers  # qkv, o_proj, gate_up, down per layer
    assert counts["kv_write"] >= layers
    assert counts["attention"] >= layers
    assert counts["sampler"] == 0


def test_named_scopes_and_sampler_modules():
    def step(cache, x, w, slots):
        with jax.named_scope("kv_write"):
            cache = cache.at[slots].set(x)
        with jax.named_scope("attention"):
            scores = jnp.einsum("td,sd->ts", x, cache)
        return cache, jnp.tanh(scores @ cache) @ w

    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.normal(size=(64, 32)), jnp.float32),
            jnp.asarray(rng.normal(size=(8, 32)), jnp.float32),
            jnp.asarray(rng.normal(size=(32, 32)), jnp.float32), jnp.arange(8, dtype=jnp.int32))
    counts = _entry_categories(jax.jit(step).lower(*args).compile().as_text())
    assert counts["kv_write"] >= 1 and counts["attention"] >= 1 and counts["matmul"] >= 1

    def sampler_like(logits):
        return jax.lax.top_k(logits, 4)[1], jnp.argmax(logits, axis=-1)

    text = jax.jit(sampler_like).lower(jnp.ones((2, 100))).compile().as_text()
    text = text.replace("HloModule jit_sampler_like", "HloModule jit_run_sampler", 1)
    counts = _entry_categories(text)
    assert set(counts) == {"sampler"}


@pytest.mark.parametrize("op, module, want", [("dot.3", "jit_run_body", "matmul"),
                                              ("wrapped_scatter.2", "jit_run_body", "kv_write"),
                                              ("fusion.7", "jit_run_body", "other"),
                                              ("dot.1", "jit_run_sampler", "matmul"),
                                              ("fusion.1", "jit_run_sampler", "sampler")])
def test_fallback_by_name(op, module, want):
    assert categorize_by_name(op, module) == want
