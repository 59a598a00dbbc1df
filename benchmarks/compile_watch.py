"""Counts XLA compilations while a block runs (``jax.monitoring`` events).

A compile inside a measured window means the warm-up missed a bucket: the
benchmarks report the count and seconds next to their numbers so that a
result polluted by compiles is visible. ``CacheCounter`` tells, for a
start-up, how many executables the persistent compilation cache had
(hits) and how many were compiled and written to it (misses).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# Recorded by jax around ``compile_or_get_cached`` (jax._src.interpreters.pxla):
# every executable jit did not have in memory, whether XLA compiled it or it was
# loaded from the persistent compilation cache (``CacheCounter`` tells them apart).
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # jax._src.compiler
_CACHE_MISS_EVENT = "/jax/compilation_cache/cache_misses"  # jax._src.compilation_cache


class CacheCounter:
    """Persistent compilation cache ``hits`` and ``misses`` since ``watch()`` was entered."""

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self._active = False

    def _listener(self, event: str, **_: object) -> None:
        if self._active:
            self.hits += event == _CACHE_HIT_EVENT
            self.misses += event == _CACHE_MISS_EVENT

    @contextlib.contextmanager
    def watch(self) -> Iterator["CacheCounter"]:
        import jax.monitoring

        self.hits, self.misses, self._active = 0, 0, True
        jax.monitoring.register_event_listener(self._listener)
        try:
            yield self
        finally:
            self._active = False
            try:
                from jax._src import monitoring

                monitoring.unregister_event_listener(self._listener)
            except (ImportError, AttributeError, ValueError):
                pass  # the listener stays registered, inactive

    def as_dict(self) -> dict[str, int]:
        return {"cache_hits": self.hits, "cache_misses": self.misses}


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
