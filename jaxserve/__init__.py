"""jaxserve: vLLM's serving design on JAX and Pallas.

Public names are imported lazily so that ``import jaxserve`` stays cheap and
the api / engine processes never pull in jax.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "SamplingParams": "jaxserve.sampling_params",
    "LLM": "jaxserve.llm",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
