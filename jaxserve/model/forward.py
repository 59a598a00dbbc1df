"""The jitted step: ``(params, kv_cache, step inputs) -> (logits, kv_cache)``.

Split in two executables, as DESIGN.md asks: the model body is keyed on T
(the token bucket; its attention metadata uses a fixed row count) and the
logits on R (the request bucket), so the number of executables grows as
|T ladder| + |R ladder|. ``forward`` composes both in one call for tests and
simple callers. The KV cache is donated: updates are in place.

The NNX module is split once (``nnx.split``); the jitted functions take the
static ``graphdef`` (a ``StaticGraph``, whose hash is computed once) and the
parameters as a pure dict, and merge them at trace time, so no NNX object is
traversed per step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.graph import StaticGraph
from jaxserve.model.kv_cache import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Fixed-shape device inputs of one step (T tokens, R rows sampled)."""

    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    attention: AttentionMetadata
    logits_indices: jax.Array  # i32[R] token index whose logits each row needs


@functools.partial(jax.jit, static_argnames=("graphdef", "backend"), donate_argnames=("kv_cache",))
def model_body(graphdef: StaticGraph, state: dict, kv_cache: KVCache, input_ids: jax.Array,
               positions: jax.Array, metadata: AttentionMetadata, *, backend: str
               ) -> tuple[jax.Array, KVCache]:
    """Runs every layer over the step's tokens.

    Args:
      graphdef, state: the split CausalLM (``load_model``'s graph and params).
      kv_cache: the cache, donated.
      input_ids, positions: i32[T].
      metadata: slot mapping, block table, seq lens, query start loc.
      backend: attention backend (jaxserve.model.attention.ATTENTION_BACKENDS).

    Returns:
      (hidden [T, D] in the parameter dtype, updated kv_cache).
    """
    model = graphdef.merge(state)
    return model(input_ids, positions, kv_cache, metadata, backend)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def compute_logits(graphdef: StaticGraph, state: dict, hidden: jax.Array,
                   logits_indices: jax.Array) -> jax.Array:
    """hidden [T, D], logits_indices i32[R] → logits f32[R, V]."""
    model = graphdef.merge(state)
    return model.logits(hidden[logits_indices])


@functools.partial(jax.jit, static_argnames=("graphdef", "backend"), donate_argnames=("kv_cache",))
def forward(graphdef: StaticGraph, state: dict, kv_cache: KVCache, inputs: StepInputs,
            *, backend: str) -> tuple[jax.Array, KVCache]:
    """One step in one executable: returns (logits f32[R, V], updated kv_cache)."""
    model = graphdef.merge(state)
    hidden, kv_cache = model(inputs.input_ids, inputs.positions, kv_cache, inputs.attention, backend)
    return model.logits(hidden[inputs.logits_indices]), kv_cache
