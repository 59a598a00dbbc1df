"""Helpers shared by jaxserve's server processes (api, engine) and the launcher (jax-free).

- ``setup_logging(process, level)``: stderr logging whose lines name the process.
- ``die_with_parent()``: Linux ``PR_SET_PDEATHSIG``: the kernel sends SIGTERM
  to this process when the process that started it dies (even by SIGKILL),
  so a killed launcher leaves no orphans. A no-op elsewhere.
- ``die_with_launcher()``: ``die_with_parent()`` for a process the launcher
  started, called by that process itself first thing in its ``main``.
- ``keep_torch_out()``: makes ``import torch`` fail in a server or launching process,
  so that transformers (tokenizers, model configs) starts without it.
- ``StopSignal``: turns SIGINT / SIGTERM into an event a main thread waits on.
- ``free_port(host)``: an unused TCP port to hand to a child process.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
from types import FrameType

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def setup_logging(process: str, level: str = "INFO") -> None:
    """Logs to stderr as ``time LEVEL [process] logger: message``; quiets library notices."""
    quiet_library_notices()
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, force=True,
        format=f"%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s")


def quiet_library_notices() -> None:
    """Silences two start-up notices that are not problems; warnings and errors still show.

    - transformers' advisory "PyTorch was not found..." (jaxserve never needs
      torch): ``TRANSFORMERS_NO_ADVISORY_WARNINGS=1`` unless set, which also
      reaches child processes; only ``warning_advice`` messages are affected.
    - JAX's INFO "Unable to initialize backend 'tpu'..." when no TPU library
      is installed: the ``jax._src.xla_bridge`` logger at WARNING (its
      warnings, e.g. a GPU jax cannot use, still show).
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def keep_torch_out() -> None:
    """Makes ``import torch`` raise ImportError in this process (a ``None`` entry in
    ``sys.modules``, Python's documented way to block an import) unless torch is imported
    already.

    jaxserve never uses torch, but transformers imports it whenever it is installed,
    even for what jaxserve takes from it (tokenizers, model configs, generation configs),
    which work without it: transformers asks ``importlib.util.find_spec``, which answers
    None for a blocked module. Measured on the 2-core CI machine: loading the demo
    model's tokenizer and config took 5.0 s with torch installed, 1.7 s with it blocked.
    Called first thing by the server processes (api, engine, worker) and by the
    ``jaxserve serve`` and ``jaxserve demo`` commands (which launch them), never in a
    user's process (``LLM``, ``Launcher``), which may use torch itself. The block lasts
    for the life of the process: call it only where nothing will want torch.
    """
    sys.modules.setdefault("torch", None)


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Asks the kernel to send ``sig`` to this process when its parent dies (Linux only).

    One libc call. If ``parent_pid`` is given and is no longer the parent
    (it died before the call), this process exits at once.
    """
    if _LIBC is None:
        return
    _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


PARENT_PID_ENV = "JAXSERVE_PARENT_PID"  # set by the launcher in each child's environment


def die_with_launcher() -> None:
    """``die_with_parent(pid)`` when ``$JAXSERVE_PARENT_PID`` names the parent; else a no-op.

    The launcher's children call this first thing in ``main`` (and remove
    the variable, so their own children do not inherit it). The launcher
    cannot make the call for them between fork and exec: a ``preexec_fn``
    makes Python fork instead of vfork, and with grpcio >= 1.80 a process
    holding gRPC channels runs gRPC's fork handlers, whose restarted poller
    thread in the child then aborts on the epoll descriptor ``close_fds``
    closed: the child dies with SIGABRT before exec (an open gRPC bug).
    A launcher that dies before this call is caught by the parent-pid check.
    """
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is not None:
        die_with_parent(int(parent))


class StopSignal:
    """Sets ``event`` on SIGINT or SIGTERM (install from the main thread).

    The Python-level handler takes no lock: setting a ``threading.Event``
    from a handler can deadlock, because the handler runs on the main thread
    between bytecodes — possibly while that thread holds the event's own
    lock (inside ``Event.wait`` or ``Event.set``), e.g. when a second signal
    arrives while the first is being handled. Instead the interpreter writes
    each signal's number to a pipe (``signal.set_wakeup_fd``) and a daemon
    thread reading the pipe sets the event.

    Args:
      event: the event to set; None = a new one.

    Attributes:
      event: set once a stop signal arrived.
      again: set once a second stop signal arrived (e.g. "abort the drain now").
      signum: the first signal received, or None.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, event: threading.Event | None = None) -> None:
        self.event = event if event is not None else threading.Event()
        self.again = threading.Event()
        self.signum: int | None = None
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd)
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        threading.Thread(target=self._watch, args=(read_fd,), name="stop-signal",
                         daemon=True).start()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """Runs on the main thread: records the signal, takes no lock."""

    def _watch(self, read_fd: int) -> None:
        while True:
            for signum in os.read(read_fd, 64):  # one byte per signal received
                if signum in self.SIGNALS:
                    if self.signum is None:
                        self.signum = signum
                    elif self.event.is_set():
                        self.again.set()
                    self.event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once a stop signal arrived (within ``timeout`` seconds)."""
        return self.event.wait(timeout)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS's choice)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


SHUTDOWN_GRACE_ENV = "JAXSERVE_SHUTDOWN_GRACE"  # seconds; set by the launcher for its children


def shutdown_grace() -> float:
    """Seconds an engine or worker process keeps serving after its first SIGTERM / SIGINT.

    ``jaxserve serve`` drains from the api process: its engine and worker
    must outlive the drain even when a supervisor signals every process of
    the group at once (systemd's default ``KillMode=control-group``). The
    launcher sets ``$JAXSERVE_SHUTDOWN_GRACE`` (its ``shutdown_grace`` plus a
    margin); without it (a process started by hand) the answer is 0: stop at once.
    """
    try:
        return max(0.0, float(os.environ.get(SHUTDOWN_GRACE_ENV, "0")))
    except ValueError:
        return 0.0


# The worker's device variables, saved by the launcher in the environment of a
# process that sees no GPU (jaxserve.launcher.host_only_env) for the workers it starts.
WORKER_ENV = "JAXSERVE_WORKER_ENV"
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEVICE_ENV_VARS = ("CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE",
                   MEM_FRACTION_ENV)


def restore_worker_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the worker's device variables put back from ``WORKER_ENV`` (JSON; null = unset).

    A process started without GPUs (the engine) starts its worker processes
    with this, so a replacement worker gets the GPUs the first one had.
    Returns ``env`` itself when it holds no ``WORKER_ENV``.
    """
    saved = env.get(WORKER_ENV)
    if saved is None:
        return env
    out = {k: v for k, v in env.items() if k != WORKER_ENV}
    for key, value in json.loads(saved).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out
