"""Every step executable compiled once, at start-up; a guard against any compile after that.

DESIGN.md "The step plan": the worker runs a fixed set of executables — the
model body per T bucket, the LM head + sampler per R bucket, and the
penalty-statistics helpers per R — so all of them are compiled (or loaded
from JAX's persistent compilation cache) in ``initialize``, before the first
request, with a progress bar and the total time logged:

    report = compile_all(executables)          # [StepExecutable] -> CompileReport
    guard = RecompileGuard(strict=...); guard.arm()
    ...
    with guard.watch(f"step {step_id}"):        # every execute()
        run the step

Compiles are observed through ``jax.monitoring``: JAX records
``/jax/core/compile/backend_compile_duration`` each time it obtains a new XLA
executable, whether compiled or loaded from the persistent cache, and
``/jax/compilation_cache/cache_hits`` for the loads. ``jit(f).lower(...)
.compile()`` fills the same executable cache that ``jit(f)(...)`` calls use,
so compiling ahead of time from abstract shapes (``jax.ShapeDtypeStruct``)
is enough: nothing runs, nothing is allocated.

The persistent cache is process-wide JAX state: ``configure_persistent_cache``
points it at a directory with a minimum compile time of 0 (so the CPU's
sub-second compiles are cached too).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import jax

from jaxserve.step_plan import RecompileError

logger = logging.getLogger(__name__)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class _CompileCounter:
    """Process-wide and per-thread counts of executables JAX obtained (one listener)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.compiles = 0
        self.cache_hits = 0
        self.recent: collections.deque[str] = collections.deque(maxlen=16)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event != BACKEND_COMPILE_EVENT:
            return
        name = str(kwargs.get("fun_name", "?"))
        with self._lock:
            self.compiles += 1
            self.recent.append(name)
        self._local.compiles = self.thread_compiles() + 1
        self._local.names = getattr(self._local, "names", []) + [name]

    def _on_event(self, event: str, **kwargs) -> None:
        if event == CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    def thread_compiles(self) -> int:
        """Executables obtained by the calling thread so far."""
        return getattr(self._local, "compiles", 0)

    def thread_names(self, since: int) -> list[str]:
        """Names of the calling thread's executables from its ``since``-th on."""
        return getattr(self._local, "names", [])[since:]


COUNTER = _CompileCounter()


def configure_persistent_cache(directory: str | None) -> None:
    """Points JAX's persistent compilation cache at ``directory`` (None: leave it).

    Minimum compile time and entry size are set to 0 so every executable is
    cached. Process-wide; changing the directory after executables were
    cached resets JAX's cache object so later compiles use the new one.
    """
    if directory is None:
        return
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if jax.config.jax_compilation_cache_dir != directory:
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.set_cache_dir(directory)
        compilation_cache.reset_cache()
    logger.info("persistent compilation cache: %s", directory)


@dataclasses.dataclass(frozen=True, slots=True)
class StepExecutable:
    """One executable of the ladder: its name and how to lower it from abstract shapes.

    Attributes:
      kind: "body" (keyed on T), "sampler" (keyed on R), "penalty" (keyed on R).
      name: e.g. "body[T=64]".
      lower: returns the ``jax.stages.Lowered`` for the executable's shapes.
    """

    kind: str
    name: str
    lower: Callable[[], jax.stages.Lowered]


@dataclasses.dataclass(frozen=True, slots=True)
class CompileReport:
    """What ``compile_all`` did.

    Attributes:
      num_executables: executables of the ladder (each compiled or loaded once).
      by_kind: how many of each kind.
      seconds: wall time, lowering included.
      num_backend_compiles: XLA executables obtained (compiled or loaded),
        small helper computations included.
      num_cache_hits: of those, loaded from the persistent cache.
    """

    num_executables: int
    by_kind: dict[str, int]
    seconds: float
    num_backend_compiles: int
    num_cache_hits: int


def compile_all(executables: Sequence[StepExecutable], *, progress: bool = True,
                desc: str = "compiling step executables") -> CompileReport:
    """Lowers and compiles every executable (or loads it from the persistent cache).

    Shows a tqdm progress bar on stderr (``progress``) and logs the total time.
    """
    from tqdm.auto import tqdm

    start = time.perf_counter()
    compiles, hits = COUNTER.compiles, COUNTER.cache_hits
    by_kind: collections.Counter[str] = collections.Counter()
    with tqdm(total=len(executables), desc=desc, unit="exe", disable=not progress,
              leave=False) as bar:
        for exe in executables:
            bar.set_postfix_str(exe.name, refresh=False)
            exe.lower().compile()
            by_kind[exe.kind] += 1
            bar.update(1)
    report = CompileReport(
        num_executables=len(executables), by_kind=dict(by_kind),
        seconds=time.perf_counter() - start,
        num_backend_compiles=COUNTER.compiles - compiles,
        num_cache_hits=COUNTER.cache_hits - hits)
    logger.info("%d step executables (%s) ready in %.1f s: %d XLA executables, %d loaded from "
                "the persistent compilation cache", report.num_executables,
                ", ".join(f"{n} {k}" for k, n in sorted(by_kind.items())), report.seconds,
                report.num_backend_compiles, report.num_cache_hits)
    return report


class RecompileGuard:
    """Counts (and in strict mode refuses) compiles after warm-up.

    Args:
      strict: raise ``RecompileError`` from ``watch`` when the watched block
        compiled anything (tests); otherwise log a warning and count it.

    Attributes:
      armed: ``arm`` was called (warm-up is over).
      num_recompiles: compiles seen in watched blocks since ``arm``.
    """

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.armed = False
        self.num_recompiles = 0

    def arm(self) -> None:
        self.armed = True

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Counts the executables the calling thread obtains inside the block.

        Raises:
          RecompileError: strict mode, armed, and the block compiled.
        """
        before = COUNTER.thread_compiles()
        yield
        new = COUNTER.thread_compiles() - before
        if not new or not self.armed:
            return
        self.num_recompiles += new
        names = COUNTER.thread_names(before)
        message = (f"{what} compiled {new} executable(s) after warm-up: {names}; every step "
                   f"executable should come from the ladder compiled at start-up")
        if self.strict:
            raise RecompileError(message)
        logger.warning(message)
