"""Counts XLA compilations while a block runs (``jax.monitoring`` events).

A compile inside a measured window means the warm-up missed a bucket: the
benchmarks report the count and seconds next to their numbers so that a
result polluted by compiles is visible.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# Recorded by jax for every backend compile (jax._src.dispatch); a load from the
# persistent compilation cache does not emit it.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """``count`` compiles and their ``seconds`` since ``watch()`` was entered."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._active = False

    def _listener(self, event: str, duration: float, **_: object) -> None:
        if self._active and event == _COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    @contextlib.contextmanager
    def watch(self) -> Iterator["CompileCounter"]:
        import jax.monitoring

        self.count, self.seconds, self._active = 0, 0.0, True
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        try:
            yield self
        finally:
            self._active = False
            _unregister(self._listener)

    def as_dict(self) -> dict[str, float]:
        return {"compiles": self.count, "compile_seconds": round(self.seconds, 3)}


def _unregister(listener) -> None:
    try:
        from jax._src import monitoring  # jax.monitoring exports no unregister

        monitoring.unregister_event_duration_listener(listener)
    except (ImportError, AttributeError, ValueError):
        pass  # the listener stays registered, inactive
