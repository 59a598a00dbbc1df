"""Assertions on lowered programs, shared by tests.

``assert_no_control_flow`` checks a lowered StableHLO module for
data-dependent control flow. On a GPU, XLA runs a conditional or a while
loop by copying its predicate to the host and waiting, which stalls a
dispatched step. In JAX 0.10.2 through 0.12, ``lax.cond`` and ``lax.switch``
lower to ``stablehlo.case`` and ``lax.while_loop``, ``fori_loop`` (not
unrolled) and ``scan`` to ``stablehlo.while``; ``stablehlo.if`` is checked too.

``lower_for_cuda`` lowers for the GPU without one: ``jax.jit(fn).trace(*specs)
.lower(lowering_platforms=("cuda",))`` inside ``pallas_kernels.gpu_target.
abstract_gpu()``, which the Pallas Triton lowering needs from jax 0.11 on.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax

from pallas_kernels.gpu_target import abstract_gpu

CONTROL_FLOW_OPS = ("stablehlo.case", "stablehlo.if", "stablehlo.while")
_CONTROL_FLOW = re.compile(r"\bstablehlo\.(case|if|while)\b")


def lower_for_cuda(fn: Callable, *specs, donate_argnums: int | Sequence[int] = ()) -> str:
    """StableHLO text of ``jax.jit(fn)`` lowered for platform ``cuda`` (an abstract H100).

    Args:
      fn: the function to jit.
      *specs: its arguments, usually ``jax.ShapeDtypeStruct`` pytrees.
      donate_argnums: as ``jax.jit``'s.

    Returns:
      ``jax.stages.Lowered.as_text()``: the StableHLO MLIR module.
    """
    with abstract_gpu():
        jitted = jax.jit(fn, donate_argnums=donate_argnums)
        return jitted.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def control_flow_ops(lowered_text: str) -> list[str]:
    """The control-flow ops in a StableHLO module's text, in order of appearance."""
    return ["stablehlo." + m.group(1) for m in _CONTROL_FLOW.finditer(lowered_text)]


def assert_no_control_flow(lowered_text: str) -> None:
    """Fails if the StableHLO text holds a ``case``, ``if`` or ``while`` op.

    Args:
      lowered_text: ``jax.stages.Lowered.as_text()`` (StableHLO MLIR).

    Raises:
      AssertionError: naming the ops found and the first line holding one.
    """
    found = control_flow_ops(lowered_text)
    if found:
        line = next(l for l in lowered_text.splitlines() if _CONTROL_FLOW.search(l))
        raise AssertionError(f"data-dependent control flow: {sorted(set(found))} "
                             f"({len(found)} ops); first: {line.strip()[:200]}")
