"""Device-side timing of one jitted function: many calls inside one executable.

Timing ``fn(*args).block_until_ready()`` call by call measures, on a GPU, the
host: the dispatch of the executable and the round trip of the wait, which
for a kernel of a few microseconds is most of the time. Here ``iters`` calls
run inside ONE jitted call, chained by a data dependence XLA cannot hoist or
merge: call i + 1's q is ``q + eps * out_i`` with ``eps`` a runtime scalar
(0.0, so every call computes the same values, but the compiler cannot know
it). The loop is ``jax.lax.fori_loop(..., unroll=True)``: a straight chain of
kernels with no device-side while loop (XLA's GPU backend evaluates a while
loop's condition on the host each iteration).

The time of one call is the difference of two chains, ``(t(2n) - t(n)) / n``
(medians over ``repeats``): the dispatch, the wait and any per-executable
cost appear once in each chain and cancel. With ``trace_dir`` a
``jax.profiler`` trace cross-checks it where the trace has a device timeline
(a GPU): the summed duration of the device's events while the n-call chain
runs, over n. The
same code runs on a CPU (where the kernel runs in interpret mode: the
numbers test the code path, they measure nothing).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DeviceTiming:
    """Seconds per call of a chained function.

    Fields:
      seconds: ``(t(2n) - t(n)) / n``, the device time of one call; when the
        difference is not positive (noise larger than n calls), the chain's
        ``t(2n) / 2n`` instead and ``differential`` is False.
      chain_seconds: ``t(2n) / 2n``, one call with the chain's dispatch
        amortised over 2n calls (an upper bound on ``seconds``).
      host_sync_seconds: median of one call with a host wait after each (the
        old, host-bound measurement, kept for contrast).
      iters: n. differential: see ``seconds``.
      trace_seconds: device busy time of one call from a ``jax.profiler``
        trace of the n-call chain (every device event: the kernel, any
        combine step, the chain's ``q + eps * out`` update); None when not
        traced or the trace has no device timeline (a CPU).
    """

    seconds: float
    chain_seconds: float
    host_sync_seconds: float
    iters: int
    differential: bool
    trace_seconds: float | None = None


def chain(fn: Callable[..., jax.Array], iters: int) -> Callable[..., jax.Array]:
    """``jit``'d ``(q, *rest, eps) -> out`` running ``fn(q, *rest)`` ``iters`` times.

    ``fn`` must return an array of q's shape (attention: [T, N, H]); call
    i + 1 takes ``q + eps * out_i`` (in q's dtype), so the calls run in order
    and none can be elided. Returns the last call's output.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")

    @jax.jit
    def chained(q, *rest_and_eps):
        *rest, eps = rest_and_eps

        def body(_, carry):
            q_i, _ = carry
            out = fn(q_i, *rest)
            return (q_i + (eps * out.astype(jnp.float32)).astype(q_i.dtype), out)

        _, out = jax.lax.fori_loop(0, iters, body, (q, jnp.zeros_like(q)), unroll=True)
        return out

    return chained


def _median_wall(f: Callable[[], jax.Array], repeats: int) -> float:
    jax.block_until_ready(f())  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_seconds(fn: Callable[..., jax.Array], q: jax.Array, rest: tuple, *, iters: int,
                   repeats: int = 5, trace_dir: str | None = None) -> DeviceTiming:
    """Times ``fn(q, *rest)`` on the device (see the module docstring).

    Args:
      fn: the function to time; returns an array shaped like ``q``.
      q: its first argument, the one the chain feeds back into.
      rest: its other arguments (device arrays).
      iters: n, calls in the shorter chain (the longer has 2n).
      repeats: timed executions of each chain (after one to compile).
      trace_dir: if set, one more execution of the n-call chain (already
        compiled) runs under ``jax.profiler.trace(trace_dir)``, and
        ``trace_seconds`` is its device busy time / n (None without a device
        timeline, as on a CPU).
    """
    eps = jnp.float32(0.0)
    short, long = chain(fn, iters), chain(fn, 2 * iters)
    t_short = _median_wall(lambda: short(q, *rest, eps), repeats)
    t_long = _median_wall(lambda: long(q, *rest, eps), repeats)
    single = jax.jit(fn)
    host_sync = _median_wall(lambda: single(q, *rest), repeats)
    chain_s = t_long / (2 * iters)
    diff = (t_long - t_short) / iters
    traced = None
    if trace_dir is not None:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(short(q, *rest, eps))
        busy = device_busy_seconds(trace_dir)
        traced = None if busy is None else busy[0] / iters
    return DeviceTiming(seconds=diff if diff > 0 else chain_s, chain_seconds=chain_s,
                        host_sync_seconds=host_sync, iters=iters, differential=diff > 0,
                        trace_seconds=traced)


def device_busy_seconds(trace_dir: str) -> tuple[float, int] | None:
    """(summed seconds, count) of the device's stream events in the newest trace under a folder.

    Device timelines are the trace's processes named ``/device:...`` (a GPU;
    not ``/host:CPU``). Of those, only threads named ``Stream...`` count when
    there are any: the profiler also derives lines such as ``XLA Ops`` and
    ``XLA Modules`` that span the same kernels again. None when the trace
    has no device events, as on a CPU, or there is no trace.
    """
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return None
    with gzip.open(max(files, key=os.path.getmtime), "rt") as f:
        events = json.load(f).get("traceEvents", [])
    meta = [e for e in events if e.get("ph") == "M"]
    device_pids = {e["pid"] for e in meta if e.get("name") == "process_name"
                   and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    streams = {(e["pid"], e.get("tid")) for e in meta
               if e.get("name") == "thread_name" and e.get("pid") in device_pids
               and str(e.get("args", {}).get("name", "")).startswith("Stream")}
    busy = [float(e.get("dur", 0.0)) for e in events
            if e.get("ph") == "X" and e.get("pid") in device_pids
            and (not streams or (e["pid"], e.get("tid")) in streams)]
    if not busy:
        return None
    return sum(busy) * 1e-6, len(busy)
