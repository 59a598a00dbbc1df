"""The served ladder of a tiny random-weight bf16 Llama with Pallas attention (abstract shapes)."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp

from jaxserve.model.kv_cache import kv_cache_shapes
from jaxserve.model.loader import load_model
from jaxserve.worker.executables import LadderShapes, ladder_executables
from jaxserve.worker.rows import RowState
from tests.model.hf_tiny import make_tiny_model


def tiny_pallas_ladder(directory: pathlib.Path, token_buckets: tuple[int, ...],
                       request_buckets: tuple[int, ...], quantization: str | None = None) -> list:
    """``ladder_executables`` of a tiny Llama written to ``directory`` (8 rows, 32 blocks of 16);
    ``quantization``: load it with that method (``load_model``)."""
    make_tiny_model("LlamaForCausalLM", directory)
    config, graphdef, state = load_model(directory, "bfloat16", quantization=quantization)
    kv = kv_cache_shapes(config, 32, 16, jnp.bfloat16)
    rows = RowState(8, 256, 16, config.vocab_size, config.eos_token_ids)
    hidden = jax.ShapeDtypeStruct((8, config.hidden_size), jnp.bfloat16)
    shapes = LadderShapes(graphdef, state, kv, rows, hidden, "pallas")
    return ladder_executables(shapes, token_buckets=token_buckets,
                              request_buckets=request_buckets)
