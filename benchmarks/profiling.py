"""``--profile DIR``: trace the measured window with ``jax.profiler`` and read it back.

Use::

    profiling.prepare_process()          # first, before jax creates its backend
    ...                                  # load, warm up
    with profiling.profiled(DIR) as session:
        ...                              # the measured window
    report = session.report()            # dict; format_report(report) -> text

``prepare_process`` makes XLA dump every module it compiles as optimized
HLO text (``--xla_dump_to``, a temporary folder) and turns JAX's persistent
compilation cache off for this process, so that the executables the window
runs are compiled, hence dumped, during warm-up (a cache load dumps
nothing). The dump names each op's instruction and, through its metadata,
the model code it came from (``benchmarks.hlo_categories``). Without the
dump (``prepare_process`` not called early enough) ops are categorized from
their names alone, which cannot tell attention from the rest.

The trace (``DIR/plugins/profile/<run>/*.xplane.pb``, TensorBoard / XProf can
open it; ``*.trace.json.gz`` for Perfetto) is read with
``jax.profiler.ProfileData``; ``benchmarks.trace_analysis`` does the sums.
The Python tracer is off (it would slow the host loop it is measuring).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from benchmarks import hlo_categories, trace_analysis

logger = logging.getLogger(__name__)

WINDOW = "jaxserve_bench_window"
STEP_MARK = "jaxserve_step"  # + " T=<tokens> R=<rows>"
_dump_dir: str | None = None


class MarkingWorker:
    """A ``jaxserve.step_plan.Worker`` that runs each step inside a trace annotation.

    The annotation (``"jaxserve_step T=16 R=4"``) names the plan's bucket, so
    the trace analysis knows which compiled variant of the body each
    execution was (variants share their module and op names). Everything
    else is the wrapped worker's.
    """

    def __init__(self, inner: Any):
        self.inner = inner

    def initialize(self, init: Any) -> Any:
        return self.inner.initialize(init)

    def execute(self, plan: Any) -> Any:
        import jax

        name = f"{STEP_MARK} T={plan.num_tokens_bucket} R={plan.num_reqs_bucket}"
        with jax.profiler.TraceAnnotation(name):
            return self.inner.execute(plan)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:  # the wrapped worker's counters and helpers
        return getattr(self.inner, name)


def marking_worker() -> MarkingWorker:
    """A ``MarkingWorker`` around a new ``InProcessWorker``."""
    from jaxserve.worker import InProcessWorker

    return MarkingWorker(InProcessWorker())


def prepare_process() -> str | None:
    """Turns on the HLO dump and off the compilation cache; returns the dump folder.

    Must run before jax initializes its backend (before the first jax
    computation); later it only logs a warning and returns None.
    """
    global _dump_dir
    if _dump_dir is not None:
        return _dump_dir
    if "jax" in sys.modules and _backend_started():
        logger.warning("jax already started: the profile will categorize ops by name only")
        return None
    _dump_dir = tempfile.mkdtemp(prefix="jaxserve-hlo-")
    atexit.register(shutil.rmtree, _dump_dir, ignore_errors=True)  # tens of MB of text
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={_dump_dir} --xla_dump_hlo_as_text".strip()
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    return _dump_dir


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):
        return True


class Session:
    """One profiled window: ``report()`` reads the trace back."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        self.window_ns: tuple[int, int] | None = None
        self.compile_seconds = 0.0

    def xplane(self) -> pathlib.Path:
        paths = sorted(self.directory.glob("plugins/profile/*/*.xplane.pb"),
                       key=lambda p: p.stat().st_mtime)
        if not paths:
            raise FileNotFoundError(f"no *.xplane.pb under {self.directory}/plugins/profile")
        return paths[-1]

    def report(self) -> dict[str, Any]:
        """The ``trace_analysis.breakdown`` of the window, plus where the trace is."""
        path = self.xplane()
        events, window, compile_ns, marks = read_xplane(path)
        modules = hlo_categories.load_dump(_dump_dir) if _dump_dir else []
        execs = trace_analysis.executions(events, make_categorizer(modules), marks)
        result = trace_analysis.breakdown(execs, window)
        result.update(trace=str(path), hlo_modules=len(modules),
                      compile_ms_in_window=round(compile_ns / 1e6, 3), step_marks=len(marks),
                      categorized_by="hlo dump" if modules else "op name only")
        return result


@contextlib.contextmanager
def profiled(directory: str | os.PathLike) -> Iterator[Session]:
    """Traces the block into ``directory`` (created) and marks it as the window."""
    import jax

    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    session = Session(path)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 2
    with jax.profiler.trace(str(path), profiler_options=options):
        with jax.profiler.TraceAnnotation(WINDOW):
            yield session
        time.sleep(0.01)  # let the last op events land inside the trace


def read_xplane(path: str | os.PathLike) -> tuple[
        list[trace_analysis.OpEvent], tuple[int, int], int, list[trace_analysis.StepMark]]:
    """(XLA op events, the window (ns), ns compiling inside it, step marks) from an ``.xplane.pb``.

    Raises:
      ValueError: the trace has no ``WINDOW`` annotation.
    """
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(path))
    events, window, compiles, marks = [], None, [], []
    for plane in data.planes:
        for thread, line in enumerate(plane.lines):
            for event in line.events:
                name = event.name
                if name == WINDOW:
                    window = (int(event.start_ns), int(event.start_ns + event.duration_ns))
                    continue
                if name.startswith(STEP_MARK):
                    fields = dict(f.split("=", 1) for f in name.split()[1:] if "=" in f)
                    start = int(event.start_ns)
                    marks.append(trace_analysis.StepMark(
                        start, start + int(event.duration_ns), int(fields.get("T", 0)),
                        int(fields.get("R", 0))))
                    continue
                if name.endswith("Compile") and "PjRt" in name:
                    compiles.append((int(event.start_ns), int(event.start_ns + event.duration_ns)))
                    continue
                stats = dict(event.stats)
                op = stats.get("hlo_op")
                if op is None:
                    continue
                start = int(event.start_ns)
                events.append(trace_analysis.OpEvent(
                    thread=hash((plane.name, thread)), start=start,
                    end=start + int(event.duration_ns), module=str(stats.get("hlo_module", "?")),
                    op=str(op), run_id=int(stats.get("run_id", 0))))
    if window is None:
        raise ValueError(f"{path}: no {WINDOW!r} annotation in the trace")
    compile_ns = sum(min(b, window[1]) - max(a, window[0]) for a, b in compiles
                     if b > window[0] and a < window[1])
    return events, window, compile_ns, marks


def make_categorizer(modules: list[hlo_categories.HloModule]) -> trace_analysis.Categorizer:
    """Picks, per execution, the dumped variant of its module that ran.

    Variants of one function share the module name and mostly the op names;
    the step mark's T (when there is one) narrows them to the variant
    compiled for that T, then the most ops in common decides. Ops the
    chosen variant lacks are categorized by name.
    """
    by_name: dict[str, list[hlo_categories.HloModule]] = {}
    for module in modules:
        by_name.setdefault(module.name, []).append(module)

    def categorize(module_name: str, ops: frozenset[str], num_tokens: int | None):
        variants = by_name.get(module_name, [])
        if num_tokens is not None:
            variants = [v for v in variants if v.num_tokens == num_tokens] or variants
        best = max(variants, key=lambda m: len(ops & m.categories.keys()), default=None)
        if best is None:
            tokens = num_tokens if "body" in module_name else None
            return functools.partial(hlo_categories.categorize_by_name,
                                     module_name=module_name), tokens
        if ops <= best.categories.keys():
            return best.categories.__getitem__, best.num_tokens

        def by_variant_then_name(op: str) -> str:
            category = best.categories.get(op)
            return category or hlo_categories.categorize_by_name(op, module_name)

        return by_variant_then_name, best.num_tokens

    return categorize


def format_report(report: dict[str, Any], max_steps: int = 12) -> str:
    """A text table: whole-window % of wall, mean ms per step by bucket, the first steps."""
    keys = trace_analysis.KEYS
    head = "".join(f"{k:>11s}" for k in keys)
    pct = report["percent_of_wall"]
    lines = [f"profile ({report['categorized_by']}): {report['num_steps']} steps, "
             f"{report['wall_ms']:.0f} ms wall, trace {report['trace']}",
             f"  % of wall        {''.join(f'{pct[k]:10.1f}%' for k in keys)}",
             f"  mean ms/step T   {head}{'   step ms':>11s}  steps"]
    for row in report["by_bucket"]:
        lines.append(f"  {'':14s} {str(row['num_tokens']):>3s}"
                     + "".join(f"{row[k]:11.2f}" for k in keys)
                     + f"{row['duration_ms']:11.2f}  {row['steps']:5d}")
    lines.append(f"  first steps (ms)  {head}{'   step ms':>11s}")
    for i, step in enumerate(report["steps"][:max_steps]):
        lines.append(f"  step {i:3d} T={str(step['num_tokens']):>4s}  "
                     + "".join(f"{step[k]:11.2f}" for k in keys)
                     + f"{step['duration_ms']:11.2f}")
    if report.get("compile_ms_in_window"):
        lines.append(f"  compiles inside the window: {report['compile_ms_in_window']:.0f} ms "
                     "(counted as host_gap)")
    return "\n".join(lines)
