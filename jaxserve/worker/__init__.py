"""The worker: model weights, physical KV cache, persistent rows, jitted step + sampler.

``InProcessWorker`` implements ``jaxserve.step_plan.Worker`` in the engine's
process (imported lazily: ``jaxserve.worker.sampler`` users need not load
the model code).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "InProcessWorker":
        from jaxserve.worker.in_process import InProcessWorker

        return InProcessWorker
    raise AttributeError(f"module 'jaxserve.worker' has no attribute {name!r}")
