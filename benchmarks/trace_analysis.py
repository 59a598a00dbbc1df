"""Where the time of each engine step went, from the ops of a JAX profiler trace.

Input: the XLA operations (thunks) the trace recorded, each ``OpEvent``
(thread, start/end in ns, HLO module, HLO op, run id), the measured window,
and a category per (module variant, op) from ``benchmarks.hlo_categories``.

- An *execution* is one run of one compiled module (one run id): its span
  is from its first op's start to its last op's end.
- Inside an execution, time is split between categories exactly: on each
  thread the innermost op owns the time (a ``while`` owns only what its
  body ops leave), and when k threads run ops at once each gets 1/k of the
  interval. Span time with no op running is ``exec_idle`` (the thunk
  executor's own overhead).
- A *step* starts at an execution of a body module (one whose T is known:
  the worker's ``jit_body_T<T>``, or one whose ENTRY takes ``input_ids``)
  and runs to the next one; its ``host_gap`` is the time
  inside it not covered by any execution: the host scheduling, building
  inputs, dispatching and reading results back while the device waits.
- Totals are over the whole window (wall time): every category, exec_idle
  and host_gap add up to the window (``host_gap`` includes the window's
  edges before the first and after the last execution).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Callable, Iterable, Sequence

from benchmarks.hlo_categories import CATEGORIES


@dataclasses.dataclass(frozen=True, slots=True)
class OpEvent:
    """One XLA operation: times in ns."""

    thread: int
    start: int
    end: int
    module: str
    op: str
    run_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class Execution:
    module: str
    run_id: int
    start: int
    end: int
    busy: dict[str, float]  # category -> ns (split as in the module docstring)
    num_tokens: int | None  # T of a body module, None otherwise

    @property
    def span(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True, slots=True)
class StepMark:
    """A host-side annotation around one worker step: times in ns, the plan's bucket."""

    start: int
    end: int
    num_tokens: int
    num_reqs: int


# (module name, ops executed, T of the step mark around it or None)
#   -> (category of each op, T if the module is a body else None)
Categorizer = Callable[[str, frozenset[str], int | None], tuple[Callable[[str], str], int | None]]


def _mark_at(marks: Sequence[StepMark], t: int) -> StepMark | None:
    """The mark whose interval holds time ``t`` (marks sorted by start, disjoint)."""
    i = bisect.bisect_right([m.start for m in marks], t) - 1
    return marks[i] if i >= 0 and t < marks[i].end else None


def _innermost_segments(events: Sequence[OpEvent]) -> list[tuple[int, int, OpEvent]]:
    """Disjoint (start, end, owner) segments of one thread: nested ops own their time."""
    out: list[tuple[int, int, OpEvent]] = []
    stack: list[tuple[int, OpEvent]] = []  # (clamped end, event)
    cursor = 0

    def emit(a: int, b: int, owner: OpEvent) -> None:
        if b > a:
            out.append((a, b, owner))

    for event in sorted(events, key=lambda e: (e.start, -e.end)):
        while stack and stack[-1][0] <= event.start:
            end, top = stack.pop()
            emit(cursor, end, top)
            cursor = end
        if stack:
            emit(cursor, event.start, stack[-1][1])
        end = min(event.end, stack[-1][0]) if stack else event.end
        stack.append((end, event))
        cursor = event.start
    while stack:
        end, top = stack.pop()
        emit(cursor, end, top)
        cursor = end
    return out


def split_time(segments: Iterable[tuple[int, int, str]]) -> dict[str, float]:
    """Category -> ns over possibly overlapping labelled segments, overlaps shared equally."""
    points = []
    for a, b, label in segments:
        points.append((a, 1, label))
        points.append((b, -1, label))
    points.sort(key=lambda p: (p[0], p[1]))
    active: collections.Counter[str] = collections.Counter()
    total = 0
    out: dict[str, float] = collections.defaultdict(float)
    previous = None
    for t, delta, label in points:
        if previous is not None and total > 0 and t > previous:
            for name, count in active.items():
                if count:
                    out[name] += (t - previous) * count / total
        active[label] += delta
        total += delta
        previous = t
    return dict(out)


def executions(events: Iterable[OpEvent], categorizer: Categorizer,
               marks: Sequence[StepMark] = ()) -> list[Execution]:
    """Groups ops by (module, run id) and splits each execution's time by category.

    ``marks`` (optional) tell the bucket of the step each execution ran in,
    so the categorizer can pick the module variant compiled for that T.
    """
    groups: dict[tuple[str, int], list[OpEvent]] = collections.defaultdict(list)
    for event in events:
        groups[(event.module, event.run_id)].append(event)
    marks = sorted(marks, key=lambda m: m.start)
    out = []
    for (module, run_id), ops in groups.items():
        mark = _mark_at(marks, min(e.start for e in ops))
        category, num_tokens = categorizer(module, frozenset(e.op for e in ops),
                                           None if mark is None else mark.num_tokens)
        by_thread: dict[int, list[OpEvent]] = collections.defaultdict(list)
        for e in ops:
            by_thread[e.thread].append(e)
        segments = [(a, b, category(owner.op))
                    for thread_ops in by_thread.values()
                    for a, b, owner in _innermost_segments(thread_ops)]
        busy = split_time(segments)
        start, end = min(e.start for e in ops), max(e.end for e in ops)
        busy["exec_idle"] = max(0.0, (end - start) - sum(busy.values()))
        out.append(Execution(module, run_id, start, end, busy, num_tokens))
    out.sort(key=lambda x: x.start)
    return out


def _union_length(intervals: Iterable[tuple[int, int]]) -> int:
    total, cur_a, cur_b = 0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


KEYS = CATEGORIES + ("exec_idle", "host_gap")


def breakdown(execs: Sequence[Execution], window: tuple[int, int]) -> dict[str, object]:
    """Per-step and whole-window time by category (ms and % of wall); see the module docstring.

    Raises:
      ValueError: an empty window.
    """
    w0, w1 = window
    if w1 <= w0:
        raise ValueError(f"empty window {window}")
    execs = [e for e in execs if e.end > w0 and e.start < w1]
    starts = [i for i, e in enumerate(execs) if e.num_tokens is not None]
    steps = []
    for k, i in enumerate(starts):
        j = starts[k + 1] if k + 1 < len(starts) else len(execs)
        members = execs[i:j]
        end = execs[j].start if j < len(execs) else max(e.end for e in members)
        ms: dict[str, float] = collections.defaultdict(float)
        for e in members:
            for name, ns in e.busy.items():
                ms[name] += ns / 1e6
        covered = _union_length((e.start, e.end) for e in members)
        ms["host_gap"] = (end - execs[i].start - covered) / 1e6
        steps.append({"num_tokens": execs[i].num_tokens, "start_ms": (execs[i].start - w0) / 1e6,
                      "duration_ms": (end - execs[i].start) / 1e6,
                      "executions": [e.module for e in members],
                      **{key: round(ms.get(key, 0.0), 4) for key in KEYS}})
    totals: dict[str, float] = collections.defaultdict(float)
    for e in execs:
        for name, ns in e.busy.items():
            totals[name] += ns / 1e6
    wall_ms = (w1 - w0) / 1e6
    clipped = [(max(e.start, w0), min(e.end, w1)) for e in execs]
    totals["host_gap"] = wall_ms - _union_length(clipped) / 1e6
    return {
        "wall_ms": wall_ms,
        "num_steps": len(steps),
        "num_executions": len(execs),
        "totals_ms": {key: round(totals.get(key, 0.0), 3) for key in KEYS},
        "percent_of_wall": {key: round(100 * totals.get(key, 0.0) / wall_ms, 2) for key in KEYS},
        "steps": steps,
        "by_bucket": _by_bucket(steps),
        "note": ("host_gap: window time with no XLA execution running; per step it also "
                 "counts the gap between the body and the sampler executions"),
    }


def _by_bucket(steps: Sequence[dict]) -> list[dict[str, object]]:
    """Mean ms per step for each token bucket T."""
    groups: dict[int | None, list[dict]] = collections.defaultdict(list)
    for s in steps:
        groups[s["num_tokens"]].append(s)
    out = []
    for t in sorted(groups, key=lambda x: (x is None, x)):
        rows = groups[t]
        out.append({"num_tokens": t, "steps": len(rows),
                    **{f"{key}": round(sum(r[key] for r in rows) / len(rows), 3)
                       for key in ("duration_ms",) + KEYS}})
    return out
