"""The worker's executables for a ladder, as ``StepExecutable``s for the compile manager.

Each entry is one jitted function (static arguments bound) with the exact
shapes and dtypes ``InProcessWorker`` later calls it with, as
``jax.ShapeDtypeStruct``s (nothing is allocated or run):

- body: ``run_body``, keyed on T (its packed buffer's layout follows T): one
  per T on the ladder;
- sampler: ``run_sampler`` (LM head + sampler), keyed on R and the sampler
  variant: |R ladder| × |COMPILED_VARIANTS| (the masked variants, for steps
  with structured-output rows, take the step's token bitmask i32[R, W]);
- prompt logprobs: ``run_prompt_logprobs`` (LM head + logprobs of every
  token of the step), keyed on T: one per T on the ladder, run only in steps
  with prompt-logprob rows;
- rows: ``sync_rows`` per R (new rows' staged writes, padded to R) and
  ``set_penalty_row``: |R ladder| + 1;
- with a draft model (speculative decoding): ``draft_body[T]`` (``run_body``
  with the draft model and its KV cache) per T and ``draft_proposals[R]``
  (``run_draft_proposals``) per R (``draft_executables``), compiled with the
  bodies.

``split_for_startup`` orders them for start-up: everything but the middle
sampler variants, the masked ones and the prompt-logprob executables is compiled
before the worker is ready; those (``BACKGROUND_VARIANTS``, then the prompt
logprobs) are compiled after, in a background thread. Until
a middle variant is ready a step that would use it runs the cheapest ready
variant that covers it (FULL covers every unconstrained row, with FULL's
tokens bit for bit: tests/worker/test_sampler_variants.py); a step with a
constrained row waits for a masked variant that covers it (no other does), and a step with a
prompt-logprob row for its ``prompt_logprobs[T]``, so structured outputs and
prompt logprobs add nothing to the start-up.

The body returns its sampling rows' hidden states in a fixed ``[M, D]``, so
the body does not depend on R nor the sampler on T.

Shape legend: T token bucket, R request bucket, M = max_num_seqs rows,
MB blocks per row, D model dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxserve.model.kv_cache import KVCache
from jaxserve.worker.compile_manager import StepExecutable
from jaxserve.worker.device_inputs import SampleSlots
from jaxserve.worker.device_state import PenaltyState, host_rows, set_penalty_row, sync_rows
from jaxserve.worker.inputs import StepLayout
from jaxserve.worker.model_runner import (run_body, run_draft_proposals, run_prompt_logprobs,
                                         run_sampler)
from jaxserve.worker.rows import RowState
from jaxserve.worker.sampler import COMPILED_VARIANTS, FULL, GREEDY, SamplerVariant
from jaxserve.worker.sampler.bitmask import num_words
from jaxserve.worker.sampler.variants import STAGES

_I32 = np.int32


@dataclasses.dataclass(frozen=True)
class LadderShapes:
    """What fixes the executables' shapes.

    Attributes:
      graphdef, state: the model (``nnx.split``); the state's arrays are
        passed as they are (lowering does not read them).
      kv_cache: the KV cache or its ``ShapeDtypeStruct``s (only shapes matter).
      rows: the worker's ``RowState`` (M, MB, V, S and the rows' dtypes).
      hidden: ``ShapeDtypeStruct`` of the body's gathered hidden states [M, D].
      backend: the attention backend.
      placement: the sharding of everything but the model and the KV cache
        (replicated over a tensor-parallel mesh); None: the default device.
    """

    graphdef: object
    state: object
    kv_cache: KVCache
    rows: RowState
    hidden: jax.ShapeDtypeStruct
    backend: str
    placement: object = None

    def layout(self, num_tokens: int) -> StepLayout:
        rows = self.rows
        return StepLayout.for_bucket(num_tokens, rows.max_num_seqs, rows.block_size)

    def spec(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        """An argument of the worker's own (not the model's) at ``placement``."""
        return jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=self.placement)

    @property
    def device_rows(self):
        return jax.tree.map(lambda x: self.spec(x.shape, x.dtype), host_rows(self.rows))

    @property
    def penalty(self) -> PenaltyState:
        shape = (self.rows.max_num_seqs + 1, self.rows.vocab_size)
        return PenaltyState(self.spec(shape, np.bool_), self.spec(shape, _I32))


def body_name(num_tokens: int, draft: bool = False) -> str:
    return f"{'draft_body' if draft else 'body'}[T={num_tokens}]"


def body_executable(shapes: LadderShapes, num_tokens: int, key: str = "",
                    draft: bool = False) -> StepExecutable:
    """``run_body`` at T = ``num_tokens``; the KV cache and block table donated.

    ``draft``: ``shapes`` hold the draft model and its KV cache (named ``draft_body[T]``).
    """
    layout, m = shapes.layout(num_tokens), shapes.rows.max_num_seqs
    fn = functools.partial(run_body, shapes.graphdef, layout=layout, backend=shapes.backend)
    args = (shapes.state, shapes.kv_cache, shapes.device_rows.block_table,
            shapes.spec((m + 1,), _I32), shapes.spec((layout.size,), _I32))
    return StepExecutable("body", body_name(num_tokens, draft), fn, args, donate=(1, 2),
                          key=key)


def sample_slots_spec(shapes: LadderShapes) -> SampleSlots:
    """The ``SampleSlots`` the body returns, as ``ShapeDtypeStruct``s."""
    m = shapes.rows.max_num_seqs
    return SampleSlots(logits_indices=shapes.spec((m,), _I32), rows=shapes.spec((m,), _I32),
                       positions=shapes.spec((m,), _I32), draft=shapes.spec((m,), _I32),
                       start=shapes.spec((m,), _I32), server_key=shapes.spec((2,), np.uint32))


def draft_proposals_name(num_reqs: int) -> str:
    return f"draft_proposals[R={num_reqs}]"


def draft_executables(shapes: LadderShapes, token_buckets: tuple[int, ...],
                      request_buckets: tuple[int, ...], num_speculative_tokens: int
                      ) -> list[StepExecutable]:
    """A draft model's executables: ``draft_body[T]`` per T, ``draft_proposals[R]`` per R.

    ``shapes`` hold the draft model and its KV cache (the rows are the target's).
    """
    key = shape_material(shapes)
    out = [body_executable(shapes, t, key, draft=True) for t in token_buckets]
    m = shapes.rows.max_num_seqs
    for r in request_buckets:
        fn = functools.partial(run_draft_proposals, shapes.graphdef, num_reqs=r,
                               num_speculative_tokens=num_speculative_tokens,
                               backend=shapes.backend)
        args = (shapes.state, shapes.kv_cache, shapes.device_rows.block_table,
                shapes.spec((m + 1,), _I32), sample_slots_spec(shapes),
                shapes.spec((r,), np.bool_))
        out.append(StepExecutable("draft", draft_proposals_name(r), fn, args, donate=(1,),
                                  key=f"{key}|k={num_speculative_tokens}"))
    return out


def prompt_logprobs_name(num_tokens: int) -> str:
    return f"prompt_logprobs[T={num_tokens}]"


def prompt_logprobs_executable(shapes: LadderShapes, num_tokens: int,
                               key: str = "") -> StepExecutable:
    """``run_prompt_logprobs`` at T = ``num_tokens`` (the body's [T, D] states in)."""
    hidden = shapes.spec((num_tokens, shapes.hidden.shape[1]), shapes.hidden.dtype)
    fn = functools.partial(run_prompt_logprobs, shapes.graphdef)
    args = (shapes.state, hidden, shapes.spec((2, num_tokens), _I32))
    return StepExecutable("prompt_logprobs", prompt_logprobs_name(num_tokens), fn, args, key=key)


def variant_name(variant: SamplerVariant) -> str:
    """A short name: the variant's stages joined by "+", or "greedy"."""
    return "+".join(s for s in STAGES if getattr(variant, s)) or "greedy"


def sampler_name(num_reqs: int, variant: SamplerVariant) -> str:
    return f"sampler[R={num_reqs},{variant_name(variant)}]"


def sampler_executable(shapes: LadderShapes, num_reqs: int, variant: SamplerVariant,
                       key: str = "") -> StepExecutable:
    """``run_sampler`` (LM head + sampler) at R = ``num_reqs`` in ``variant``."""
    m = shapes.rows.max_num_seqs
    slots = sample_slots_spec(shapes)
    penalty = shapes.penalty if variant.processing else PenaltyState(None, None)
    bitmask = (shapes.spec((num_reqs, num_words(shapes.rows.vocab_size)), _I32)
               if variant.mask else None)
    fn = functools.partial(run_sampler, shapes.graphdef, num_reqs=num_reqs, variant=variant)
    args = (shapes.state, shapes.hidden, slots, shapes.device_rows, shapes.spec((m + 1,), _I32),
            penalty.prompt_mask, penalty.output_counts, bitmask)
    return StepExecutable("sampler", sampler_name(num_reqs, variant), fn, args,
                          donate=(4, 6), key=key)


def lower_body(shapes: LadderShapes, num_tokens: int) -> jax.stages.Lowered:
    """``run_body`` lowered at T = ``num_tokens`` (KV sizing reads its memory analysis)."""
    return body_executable(shapes, num_tokens).lower()


def lower_sampler(shapes: LadderShapes, num_reqs: int) -> jax.stages.Lowered:
    """``run_sampler`` lowered at R = ``num_reqs`` in FULL (every unconstrained row)."""
    return sampler_executable(shapes, num_reqs, FULL).lower()


def shape_material(shapes: LadderShapes, with_kv_cache: bool = True) -> str:
    """What fixes every executable of the ladder besides its bucket and the code.

    The model graph (its repr names every static attribute, the model
    configuration included), the shapes and dtypes of the parameters, the KV
    cache (``with_kv_cache``: the bodies; the samplers and row writes do not
    take it, so a KV cache of another size keeps their entries) and the
    gathered hidden states, the rows' geometry and the attention backend;
    deterministic across processes (it keys the program store).
    """
    arrays = (shapes.state, shapes.kv_cache if with_kv_cache else None, shapes.hidden)
    leaves = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(arrays)]
    rows = shapes.rows
    return repr((repr(shapes.graphdef.graphdef), str(jax.tree.structure(arrays)), leaves,
                 rows.max_num_seqs, rows.max_blocks, rows.block_size, rows.vocab_size,
                 shapes.backend))


# Compiled after the worker is ready (``split_for_startup``); GREEDY (the
# cheapest) and FULL (which covers every unconstrained row) are compiled before.
BACKGROUND_VARIANTS = tuple(v for v in COMPILED_VARIANTS if v not in (GREEDY, FULL))


def split_for_startup(executables: list[StepExecutable]
                      ) -> tuple[list[StepExecutable], list[StepExecutable]]:
    """(compiled before ready, compiled in the background after): see the module docstring.

    The second list holds the samplers of ``BACKGROUND_VARIANTS`` and the
    prompt-logprob executables, in ladder order.
    """
    later = {variant_name(v) for v in BACKGROUND_VARIANTS}
    is_later = [exe.kind == "prompt_logprobs" or (
                    exe.kind == "sampler" and exe.name.split(",", 1)[1][:-1] in later)
                for exe in executables]
    return ([exe for exe, b in zip(executables, is_later) if not b],
            [exe for exe, b in zip(executables, is_later) if b])


def ladder_executables(shapes: LadderShapes, token_buckets: tuple[int, ...],
                       request_buckets: tuple[int, ...]) -> list[StepExecutable]:
    """Every executable the worker can call for these ladders (see the module docstring)."""
    v = shapes.rows.vocab_size
    out = [body_executable(shapes, t, shape_material(shapes)) for t in token_buckets]
    key = shape_material(shapes, with_kv_cache=False)
    out += [sampler_executable(shapes, r, variant, key)
            for r in request_buckets for variant in COMPILED_VARIANTS]
    out += [prompt_logprobs_executable(shapes, t, key) for t in token_buckets]
    full = shapes.device_rows
    for r in request_buckets:
        part = jax.tree.map(lambda x: shapes.spec((r,) + x.shape[1:], x.dtype), full)
        out.append(StepExecutable("rows", f"sync_rows[R={r}]", sync_rows,
                                  (full, shapes.spec((r,), _I32), part), donate=(0,), key=key))
    spec = shapes.spec
    out.append(StepExecutable(
        "rows", "set_penalty_row", set_penalty_row,
        (shapes.penalty, spec((), _I32), spec((v,), np.bool_), spec((v,), _I32)),
        donate=(0,), key=key))
    return out
