"""Server start-up time: wall seconds to ready, and each process's CPU seconds by then.

    python -m benchmarks.startup_time [--cache-dir DIR] [--fresh] [jaxserve demo flags ...]

Starts the server processes exactly as ``jaxserve demo`` does (the demo's
engine limits and T ladder, ``jaxserve.commands.demo``), waits until they
are ready, reads every server process's CPU time (user + system, from
``/proc/PID/stat``), stops them and prints one line::

    ready 38.2 s (worker 21.5 s CPU, engine 1.1 s, api 6.0 s); compiled: 8 ...

``--cache-dir`` is the persistent compilation cache and program store
(``JAX_COMPILATION_CACHE_DIR`` of the processes); ``--fresh`` empties it
first (a cold start; the demo model itself must already be built). On a
shared machine the wall time moves with the other load, the CPU seconds
much less: compare those.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from jaxserve.commands import demo
from jaxserve.commands.serve import serve_options


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup_time")
    demo.add_arguments(parser)
    parser.add_argument("--cache-dir", required=True, help="the compilation cache directory")
    parser.add_argument("--fresh", action="store_true", help="empty --cache-dir first")
    parser.add_argument("--log-level", default="WARNING", help="the server processes' log level")
    args = parser.parse_args(argv)
    if args.fresh:
        shutil.rmtree(args.cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = args.cache_dir
    if not args.token_buckets:
        args.token_buckets = demo.demo_token_buckets(args.max_num_batched_tokens)
    from jaxserve.launcher import Launcher
    from jaxserve.procutil import free_port, keep_torch_out

    keep_torch_out()  # as jaxserve demo's own process

    launcher = Launcher(serve_options(args, port=free_port(args.host), metrics_port=0))
    start = time.monotonic()
    try:
        launcher.start()
        launcher.wait_ready(args.ready_timeout)
        ready = time.monotonic() - start
        cpu = {name: cpu_seconds(proc.pid) for name, proc in launcher.processes.items()}
    finally:
        launcher.shutdown()
    print(f"ready {ready:.1f} s (" + ", ".join(f"{n} {s:.1f} s CPU" for n, s in cpu.items())
          + f"); load average {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
