"""Every step executable compiled once, at start-up; a guard against any compile after that.

The worker runs a fixed set of executables (docs/worker.md) — the model
body per T bucket, the LM head + sampler per R bucket and sampler variant,
the staged row writes per R and one penalty-row write — so all of them are
compiled (or loaded) in ``initialize``, before the first request, with a
progress bar and the total time logged:

    report = compile_all(executables, store=program_store(dir))
    functions = report.functions                # name -> StepFunction (callable)
    guard = RecompileGuard(strict=...); guard.arm()
    ...
    with guard.watch(f"step {step_id}"):        # every step's dispatch
        functions[f"body[T={t}]"](...)

The worker calls the compiled ``StepFunction``s directly: a call off the
compiled shapes raises instead of compiling. Two caches make a restart fast:
the *program store* (``program_store.py``) keeps each executable's traced
program, so a restart runs none of the model's Python, and JAX's persistent
compilation cache keeps the compiled executables.

Compiles are observed through ``jax.monitoring``: JAX records
``/jax/core/compile/backend_compile_duration`` each time it obtains a new XLA
executable, whether compiled or loaded from the persistent cache, and
``/jax/compilation_cache/cache_hits`` for the loads.

The persistent cache is process-wide JAX state: ``configure_persistent_cache``
points it at a directory with a minimum compile time of 0 (so the CPU's
sub-second compiles are cached too).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax import export

from jaxserve.step_plan import RecompileError
from jaxserve.worker.program_store import ProgramStore, StoreUnusable, export_program

logger = logging.getLogger(__name__)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
BACKGROUND_COMPILE_THREAD = "background-compile"  # the name of ``BackgroundCompile``'s thread


class Tally:
    """Counts of executables obtained by the threads that count into it
    (``_CompileCounter.count_into``); safe to add to from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.compiles = 0
        self.cache_hits = 0

    def add(self, compiles: int = 0, cache_hits: int = 0) -> None:
        with self._lock:
            self.compiles += compiles
            self.cache_hits += cache_hits


class _CompileCounter:
    """Process-wide and per-thread counts of executables JAX obtained (one listener).

    JAX reports a compile and a persistent-cache hit on the thread that asked for the
    executable, so a count per thread (``thread_compiles``) or per group of threads
    (``count_into``) sees only its own threads' executables, whatever else the process
    compiles meanwhile (another worker's background compiles, say).
    """

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
        if (tally := self.tally()) is not None:
            tally.add(compiles=1)

    def _on_event(self, event: str, **kwargs) -> None:
        if event == CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1
            if (tally := self.tally()) is not None:
                tally.add(cache_hits=1)

    def thread_compiles(self) -> int:
        """Executables obtained by the calling thread so far."""
        return getattr(self._local, "compiles", 0)

    def thread_names(self, since: int) -> list[str]:
        """Names of the calling thread's executables from its ``since``-th on."""
        return getattr(self._local, "names", [])[since:]

    def tally(self) -> Tally | None:
        """The ``Tally`` the calling thread counts into (None: none)."""
        return getattr(self._local, "tally", None)

    def count_into(self, tally: Tally | None) -> None:
        """Adds the calling thread's executables from now on to ``tally`` (None: stop)."""
        self._local.tally = tally


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
    """One executable of the ladder: what to compile, at which abstract shapes.

    Attributes:
      kind: "body" (keyed on T), "sampler" (keyed on R), "penalty" (keyed on R).
      name: e.g. "body[T=64]".
      fn: the function, its static arguments bound; positional array arguments.
      args: the positional arguments as pytrees of ``jax.ShapeDtypeStruct``
        (or arrays: only shapes and dtypes are read).
      donate: positions of the arguments whose buffers the call consumes.
      key: a description of the shapes for the program store
        (``jaxserve.worker.program_store``); "" keeps it out of the store.
    """

    kind: str
    name: str
    fn: Callable[..., Any]
    args: tuple
    donate: tuple[int, ...] = ()
    key: str = ""

    def lower(self) -> jax.stages.Lowered:
        """The executable lowered at its shapes (for memory analysis and tests)."""
        return jax.jit(self.fn, donate_argnums=self.donate).lower(*self.args)


class StepFunction:
    """A compiled ladder executable, called with the original (pytree) arguments.

    The executable itself takes the flattened leaves; a call whose argument
    structure differs from the compiled one raises ``ValueError`` (it would
    need a new executable), and a leaf of another shape or dtype raises the
    executable's own ``TypeError``: nothing here ever compiles.
    """

    __slots__ = ("name", "compiled", "in_tree", "out_tree")

    def __init__(self, name: str, compiled: jax.stages.Compiled, in_tree, out_tree):
        self.name, self.compiled, self.in_tree, self.out_tree = name, compiled, in_tree, out_tree

    def __call__(self, *args):
        leaves, tree = jax.tree.flatten(args)
        if tree != self.in_tree:
            raise ValueError(f"{self.name}: arguments {tree} differ from the compiled {self.in_tree}")
        return jax.tree.unflatten(self.out_tree, self.compiled(*leaves))


def _flat(exe: StepExecutable) -> tuple[Callable, list, Any, tuple[int, ...], list]:
    """(flat function, flat specs, input tree, flat donated indices, cell receiving the result tree)."""
    leaves, in_tree = jax.tree.flatten(exe.args)
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_mesh_sharding(x)) for x in leaves]
    donated, offset = [], 0
    for i, arg in enumerate(exe.args):
        n = len(jax.tree.leaves(arg))
        if i in exe.donate:
            donated.extend(range(offset, offset + n))
        offset += n
    out_tree_cell: list = []

    def flat_fn(*flat_args):
        out = exe.fn(*jax.tree.unflatten(in_tree, flat_args))
        out_leaves, out_tree = jax.tree.flatten(out)
        out_tree_cell[:] = [out_tree]
        return out_leaves

    return _named(flat_fn, exe.name), specs, in_tree, tuple(donated), out_tree_cell


def _mesh_sharding(leaf):
    """A leaf's sharding when it is placed on a device mesh (tensor parallel), else None.

    Single-device leaves compile for the default device, as before meshes.
    """
    where = getattr(leaf, "sharding", None)
    return where if isinstance(where, jax.sharding.NamedSharding) else None


def _named(fn: Callable, executable_name: str) -> Callable:
    """``fn`` renamed after the executable: "body[T=64]" → XLA module ``jit_body_T64``.

    Profiles identify steps by these module names (benchmarks/hlo_categories.py).
    """
    fn.__name__ = fn.__qualname__ = re.sub(r"\W+", "_", executable_name.replace("=", "")).strip("_")
    return fn


def trace_program(exe: StepExecutable, platforms: tuple[str, ...] | None = None
                  ) -> tuple[export.Exported, Any]:
    """``exe``'s traced program (``jax.export``) and its result tree: what the store keeps.

    Args:
      platforms: lower for these (e.g. ``("cuda",)`` inside
        ``pallas_kernels.gpu_target.abstract_gpu()``); None: the default backend.

    Raises:
      StoreUnusable: the program cannot be exported (``export_program``).
    """
    flat_fn, specs, _, donated, out_tree_cell = _flat(exe)
    program = export_program(jax.jit(flat_fn, donate_argnums=donated), specs, platforms)
    return program, out_tree_cell[0]


# Tracing and lowering run one at a time, in the thread that called
# ``compile_all`` (JAX's and flax's context managers are per thread, and the
# model's Python holds the GIL anyway); XLA's compiles, which release the
# GIL, run in parallel.
_TRACE_LOCK = threading.RLock()


@dataclasses.dataclass(frozen=True, slots=True)
class _Lowered:
    lowered: jax.stages.Lowered
    in_tree: Any
    out_tree: Any
    from_store: bool  # the program came from the store
    via_store: bool  # the program went through the store (exported or loaded)


def _lower_one(exe: StepExecutable, store: ProgramStore | None) -> _Lowered:
    """The executable lowered: from its stored program, or traced (and stored).

    Raises:
      StoreUnusable: the store failed for this executable (export or write);
        the caller lowers it again without the store.
    """
    flat_fn, specs, in_tree, donated, out_tree_cell = _flat(exe)
    key = store.key(exe.name, exe.key) if store is not None and exe.key else None
    with _TRACE_LOCK:
        if key is None:
            lowered = jax.jit(flat_fn, donate_argnums=donated).lower(*specs)
            return _Lowered(lowered, in_tree, out_tree_cell[0], False, False)
        stored = store.load(key)
        from_store = stored is not None
        if stored is None:
            stored = trace_program(exe)
            store.save(key, *stored)
        program, out_tree = stored
        # A fresh trace is compiled exactly as a restart will compile it, so
        # that the restart is a persistent-cache hit.
        lowered = jax.jit(_program_call(program, exe.name), donate_argnums=donated).lower(*specs)
    return _Lowered(lowered, in_tree, out_tree, from_store, True)


class _StoreSwitch:
    """One start's program store, turned off at its first failure (logged once)."""

    def __init__(self, store: ProgramStore | None):
        self.store = store
        self.off_reason: str | None = None
        self._lock = threading.Lock()

    def turn_off(self, reason: str) -> None:
        with self._lock:
            if self.off_reason is None:
                self.off_reason = reason
                logger.warning("program store off for this start (executables are compiled "
                               "without it): %s", reason)
            self.store = None

    def lower(self, exe: StepExecutable) -> _Lowered:
        try:
            return _lower_one(exe, self.store)
        except StoreUnusable as err:
            self.turn_off(str(err))
            return _lower_one(exe, None)

    def compile(self, exe: StepExecutable, lowered: _Lowered) -> tuple[StepFunction, bool]:
        """Compiles ``lowered``; a stored program that fails to compile is compiled anew
        without the store (a genuine error then shows as itself)."""
        try:
            compiled = lowered.lowered.compile()
        except Exception as err:  # noqa: BLE001 - compiled again without the store
            if not lowered.via_store:
                raise
            self.turn_off(f"compiling the stored program of {exe.name} failed: "
                          f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}")
            lowered = _lower_one(exe, None)
            compiled = lowered.lowered.compile()
        return StepFunction(exe.name, compiled, lowered.in_tree, lowered.out_tree), \
            lowered.from_store


def _program_call(program, executable_name: str) -> Callable:
    def call(*flat_args):
        return program.call(*flat_args)

    return _named(call, executable_name)


@dataclasses.dataclass(frozen=True, slots=True)
class CompileReport:
    """What ``compile_all`` did.

    Attributes:
      num_executables: executables of the ladder (each compiled or loaded once).
      by_kind: how many of each kind.
      seconds: wall time, tracing and lowering included.
      num_backend_compiles: XLA executables obtained (compiled or loaded) by
        the call's own threads, small helper computations included.
      num_cache_hits: of those, loaded from the persistent cache.
      num_programs_loaded: executables whose traced program came from the
        program store (no tracing, no lowering of the model's Python).
      functions: name → the compiled ``StepFunction``, for the worker to call.
      store_off_reason: why the program store was turned off during this
        call (None: it was not).
    """

    num_executables: int
    by_kind: dict[str, int]
    seconds: float
    num_backend_compiles: int
    num_cache_hits: int
    num_programs_loaded: int = 0
    functions: dict[str, StepFunction] = dataclasses.field(default_factory=dict)
    store_off_reason: str | None = None

    def combined(self, later: "CompileReport") -> "CompileReport":
        """This report followed by ``later``'s (counts and seconds added)."""
        return CompileReport(
            num_executables=self.num_executables + later.num_executables,
            by_kind=dict(collections.Counter(self.by_kind) + collections.Counter(later.by_kind)),
            seconds=self.seconds + later.seconds,
            num_backend_compiles=self.num_backend_compiles + later.num_backend_compiles,
            num_cache_hits=self.num_cache_hits + later.num_cache_hits,
            num_programs_loaded=self.num_programs_loaded + later.num_programs_loaded,
            functions={**self.functions, **later.functions},
            store_off_reason=self.store_off_reason or later.store_off_reason)


def compile_threads() -> int:
    """Default compile threads: half the CPU cores, 1 to 8 (1 on a 2-core machine)."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def compile_all(executables: Sequence[StepExecutable], *, progress: bool = True,
                desc: str = "compiling step executables",
                store: ProgramStore | None = None, threads: int | None = None,
                on_ready: Callable[[str, StepFunction], None] | None = None) -> CompileReport:
    """Compiles every executable, or loads it from the program store and JAX's cache.

    With a ``store``, each executable's traced program is loaded from it when
    present (then compiled: a persistent-cache hit on a warm restart), or
    traced, stored and compiled; the first store failure turns the store off
    for the rest (one log line, ``CompileReport.store_off_reason``). Tracing
    and lowering run one executable at a time; XLA compiles run in
    ``threads`` threads (default ``compile_threads()``). Shows a tqdm
    progress bar on stderr (``progress``) and logs the total time.

    Args:
      on_ready: called with (name, function) as each executable is ready.

    Raises:
      Whatever compiling an executable without the store raises (the
      remaining compiles are cancelled).
    """
    from tqdm.auto import tqdm

    start = time.perf_counter()
    # The executables of this call's threads only (the caller's, which lowers, and the
    # pool's), not whatever other threads of the process compile meanwhile.
    tally, outer = Tally(), COUNTER.tally()
    by_kind: collections.Counter[str] = collections.Counter()
    functions: dict[str, StepFunction] = {}
    switch = _StoreSwitch(store)
    loaded = 0
    threads = threads or compile_threads()
    with tqdm(total=len(executables), desc=desc, unit="exe", disable=not progress,
              leave=False) as bar:
        pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="compile", initializer=COUNTER.count_into,
            initargs=(tally,))
        COUNTER.count_into(tally)  # restored in the finally below
        try:
            futures = {}
            for exe in executables:  # lowered here, one by one; compiled in the pool
                futures[pool.submit(switch.compile, exe, switch.lower(exe))] = exe
            for future in concurrent.futures.as_completed(futures):
                exe = futures[future]
                functions[exe.name], from_store = future.result()
                if on_ready is not None:
                    on_ready(exe.name, functions[exe.name])
                loaded += from_store
                by_kind[exe.kind] += 1
                bar.set_postfix_str(exe.name, refresh=False)
                bar.update(1)
        finally:
            pool.shutdown(cancel_futures=True)
            COUNTER.count_into(outer)
            if outer is not None:
                outer.add(tally.compiles, tally.cache_hits)
    report = CompileReport(
        num_executables=len(executables), by_kind=dict(by_kind),
        seconds=time.perf_counter() - start,
        num_backend_compiles=tally.compiles, num_cache_hits=tally.cache_hits,
        num_programs_loaded=loaded,
        functions=functions, store_off_reason=switch.off_reason)
    logger.info("%d step executables (%s) ready in %.1f s (%d compile threads): %d XLA "
                "executables, %d loaded from the persistent compilation cache, %d programs "
                "from the program store", report.num_executables,
                ", ".join(f"{n} {k}" for k, n in sorted(by_kind.items())), report.seconds,
                threads, report.num_backend_compiles, report.num_cache_hits, loaded)
    return report


class BackgroundCompile:
    """Compiles executables in a daemon thread, adding each to a dict when ready.

    For executables the worker can do without until they are ready (the
    middle sampler variants: ``executables.split_for_startup``). The
    thread's compiles are its own: a ``RecompileGuard`` watching a step on
    another thread does not count them. A failure is logged, never raised:
    the worker keeps using what it has. They compile in order, except that
    an executable a step waits for (``wait_for``) moves to the head of the
    queue: the step waits for at most the compile in progress and its own,
    not for everything before it (the first request with prompt logprobs
    after a start, say).

    Args:
      executables: what to compile, in order.
      functions: receives name → ``StepFunction`` as each is ready.
      store: the program store (None: none).
    """

    def __init__(self, executables: Sequence[StepExecutable],
                 functions: dict[str, StepFunction], store: ProgramStore | None = None):
        self._stop = threading.Event()
        self._functions = functions
        self._lock = threading.Lock()
        self._queue = collections.deque(executables)  # not yet started, next first
        self.thread = threading.Thread(target=self._run, args=(functions, store),
                                       name=BACKGROUND_COMPILE_THREAD, daemon=True)
        # A daemon thread still inside an XLA compile when the interpreter
        # finalizes aborts the process (SIGABRT, "FATAL: exception not
        # rethrown"): a script that never shuts its LLM down waits for it.
        # The thread unregisters this when it ends: the atexit entry holds
        # ``functions``, so a worker dropped without a shutdown would
        # otherwise keep every executable (and its memory maps) until exit.
        atexit.register(self._finish)
        self.thread.start()

    def _run(self, functions, store) -> None:
        try:
            self._compile(functions, store)
        finally:
            atexit.unregister(self._finish)

    def _next(self) -> StepExecutable | None:
        with self._lock:
            return self._queue.popleft() if self._queue and not self._stop.is_set() else None

    def _compile(self, functions, store) -> None:
        start, done = time.perf_counter(), 0
        switch = _StoreSwitch(store)
        try:
            while (exe := self._next()) is not None:
                functions[exe.name] = switch.compile(exe, switch.lower(exe))[0]
                done += 1
        except Exception:  # noqa: BLE001 - the worker runs on without these executables
            logger.exception("background compile failed; the worker keeps using the "
                             "executables it has")
            return
        if not self._stop.is_set():
            logger.info("%d background executables ready in %.1f s", done,
                        time.perf_counter() - start)

    def queued(self) -> list[str]:
        """The names of the executables not yet started, next first."""
        with self._lock:
            return [exe.name for exe in self._queue]

    def prioritize(self, name: str) -> bool:
        """Moves executable ``name`` to the head of the queue; False if it is not queued
        (ready, in progress, or not one of these)."""
        with self._lock:
            for i, exe in enumerate(self._queue):
                if exe.name == name:
                    del self._queue[i]
                    self._queue.appendleft(exe)
                    return True
        return False

    def wait_for(self, name: str) -> bool:
        """Waits until executable ``name`` is ready, compiling it next if it is still
        queued (``prioritize``); False if the thread ended without it."""
        self.prioritize(name)
        while name not in self._functions:
            if not self.thread.is_alive():
                return name in self._functions
            self.thread.join(0.01)
        return True

    def join(self, timeout: float | None = None) -> None:
        """Waits for every executable (or ``stop``)."""
        self.thread.join(timeout)

    def stop(self) -> None:
        """Compiles nothing more (the one in progress finishes) and waits for the thread."""
        atexit.unregister(self._finish)
        self._finish()

    def _finish(self) -> None:
        self._stop.set()
        self.thread.join()


def program_store(directory: str | None) -> ProgramStore | None:
    """The program store beside the persistent cache: ``<dir>/jaxserve-programs``.

    ``directory`` None falls back to JAX's configured cache directory; with
    neither there is no store. A store that cannot be opened is logged (one
    line) and None returned: the store never stops a start.
    """
    directory = directory or jax.config.jax_compilation_cache_dir
    if not directory:
        return None
    try:
        return ProgramStore(os.path.join(directory, "jaxserve-programs"))
    except Exception as err:  # noqa: BLE001 - the store is an optimisation
        logger.warning("program store off for this start: %s: %s", type(err).__name__,
                       str(err)[:300])
        return None


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
