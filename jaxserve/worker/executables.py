"""The worker's executables for a ladder, as ``StepExecutable``s for the compile manager.

Each entry is one jitted function of ``model_runner`` (static arguments
bound) with the exact shapes and dtypes ``InProcessWorker.execute`` later
calls it with, as ``jax.ShapeDtypeStruct``s (nothing is allocated or run):

- body: ``run_body``, keyed on T: one per T on the ladder;
- sampler: ``run_sampler`` (LM head + sampler), keyed on R: one per R;
- penalty: ``gather_penalty_rows``, ``add_output_counts`` and
  ``penalty_zeros`` per R, plus ``penalty_zeros`` at [M, V] (unless M is on
  the R ladder) and ``set_penalty_row``: 3 per R, plus 1 or 2.

The body's attention metadata has a fixed RA = M rows and returns a fixed
``[M, D]`` hidden array, so the body does not depend on R nor the sampler
on T. The penalty helpers run only in steps where a sampling row has a
penalty, but they too are compiled at start-up so no step ever compiles.

Shape legend: T token bucket, R request bucket, M = max_num_seqs rows,
MB blocks per row, D model dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.kv_cache import KVCache
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.worker.model_runner import (add_output_counts, gather_penalty_rows, penalty_zeros,
                                          run_body, run_sampler, set_penalty_row)
from jaxserve.worker.compile_manager import StepExecutable
from jaxserve.worker.inputs import prepare_sampling
from jaxserve.worker.rows import RowState

_I32 = np.int32


def _spec(shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype))


@dataclasses.dataclass(frozen=True)
class LadderShapes:
    """What fixes the executables' shapes.

    Attributes:
      graphdef, state: the model (``nnx.split``); the state's arrays are
        passed as they are (lowering does not read them).
      kv_cache: the KV cache or its ``ShapeDtypeStruct``s (only shapes matter).
      rows: the worker's ``RowState`` (M, MB, V and the padding row's
        sampling parameters).
      hidden: ``ShapeDtypeStruct`` of the body's gathered hidden states [M, D].
      backend: the attention backend.
    """

    graphdef: object
    state: object
    kv_cache: KVCache
    rows: RowState
    hidden: jax.ShapeDtypeStruct
    backend: str


def body_executable(shapes: LadderShapes, num_tokens: int, key: str = "") -> StepExecutable:
    """``run_body`` at T = ``num_tokens``, RA = M attention rows; the KV cache donated."""
    t, m, mb = num_tokens, shapes.rows.max_num_seqs, shapes.rows.max_blocks
    metadata = AttentionMetadata(slot_mapping=_spec((t,), _I32), block_table=_spec((m, mb), _I32),
                                 seq_lens=_spec((m,), _I32), query_start_loc=_spec((m + 1,), _I32))
    fn = functools.partial(run_body, shapes.graphdef, backend=shapes.backend)
    args = (shapes.state, shapes.kv_cache, _spec((t,), _I32), _spec((t,), _I32), metadata,
            _spec((m,), _I32))
    return StepExecutable("body", f"body[T={t}]", fn, args, donate=(1,), key=key)


def sampler_executable(shapes: LadderShapes, num_reqs: int, key: str = "") -> StepExecutable:
    """``run_sampler`` (LM head + sampler) at R = ``num_reqs``."""
    v = shapes.rows.vocab_size
    metadata = prepare_sampling(shapes.rows, np.zeros(0, _I32), num_reqs,
                                _spec((num_reqs, v), np.bool_), _spec((num_reqs, v), _I32),
                                MAX_LOGPROBS)
    fn = functools.partial(run_sampler, shapes.graphdef)
    args = (shapes.state, shapes.hidden, metadata, _spec((2,), np.uint32))
    return StepExecutable("sampler", f"sampler[R={num_reqs}]", fn, args, key=key)


def lower_body(shapes: LadderShapes, num_tokens: int) -> jax.stages.Lowered:
    """``run_body`` lowered at T = ``num_tokens`` (KV sizing reads its memory analysis)."""
    return body_executable(shapes, num_tokens).lower()


def lower_sampler(shapes: LadderShapes, num_reqs: int) -> jax.stages.Lowered:
    """``run_sampler`` lowered at R = ``num_reqs``."""
    return sampler_executable(shapes, num_reqs).lower()


def shape_material(shapes: LadderShapes) -> str:
    """What fixes every executable of the ladder besides its bucket and the code.

    The model graph (its repr names every static attribute, the model
    configuration included), the shapes and dtypes of the parameters, the KV
    cache and the gathered hidden states, the rows' geometry and the attention
    backend; deterministic across processes (it keys the program store).
    """
    arrays = (shapes.state, shapes.kv_cache, shapes.hidden)
    leaves = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(arrays)]
    rows = shapes.rows
    return repr((repr(shapes.graphdef.graphdef), str(jax.tree.structure(arrays)), leaves,
                 rows.max_num_seqs, rows.max_blocks, rows.vocab_size, shapes.backend))


def ladder_executables(shapes: LadderShapes, token_buckets: tuple[int, ...],
                       request_buckets: tuple[int, ...]) -> list[StepExecutable]:
    """Every executable ``execute`` can call for these ladders (see the module docstring)."""
    m, v = shapes.rows.max_num_seqs, shapes.rows.vocab_size
    mask, counts = _spec((m, v), np.bool_), _spec((m, v), _I32)
    key = shape_material(shapes)
    out = [body_executable(shapes, t, key) for t in token_buckets]
    out += [sampler_executable(shapes, r, key) for r in request_buckets]
    for r in request_buckets:
        rows = _spec((r,), _I32)
        out += [
            StepExecutable("penalty", f"gather_penalty_rows[R={r}]", gather_penalty_rows,
                           (mask, counts, rows), key=key),
            StepExecutable("penalty", f"add_output_counts[R={r}]", add_output_counts,
                           (counts, rows, rows), donate=(0,), key=key),
            StepExecutable("penalty", f"penalty_zeros[R={r}]", functools.partial(
                penalty_zeros, num_rows=r, vocab_size=v), (), key=key),
        ]
    if m not in request_buckets:
        out.append(StepExecutable("penalty", f"penalty_zeros[M={m}]", functools.partial(
            penalty_zeros, num_rows=m, vocab_size=v), (), key=key))
    out.append(StepExecutable(
        "penalty", "set_penalty_row", set_penalty_row,
        (mask, counts, _spec((), _I32), _spec((v,), np.bool_), _spec((v,), _I32)),
        donate=(0, 1), key=key))
    return out
