"""Assertions on lowered programs, shared by tests.

``assert_no_control_flow`` checks a lowered StableHLO module for
data-dependent control flow. On a GPU, XLA runs a conditional or a while
loop by copying its predicate to the host and waiting, which stalls a
dispatched step. In JAX 0.10.2, ``lax.cond`` and ``lax.switch`` lower to
``stablehlo.case`` and ``lax.while_loop``, ``fori_loop`` (not unrolled) and
``scan`` to ``stablehlo.while``; ``stablehlo.if`` is checked too.

Lower for the GPU without one: ``jax.jit(fn).trace(*specs).lower(
lowering_platforms=("cuda",)).as_text()`` with ``jax.ShapeDtypeStruct`` specs.
"""

from __future__ import annotations

import re

CONTROL_FLOW_OPS = ("stablehlo.case", "stablehlo.if", "stablehlo.while")
_CONTROL_FLOW = re.compile(r"\bstablehlo\.(case|if|while)\b")


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
