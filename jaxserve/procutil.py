"""Helpers shared by jaxserve's server processes (api, engine) and the launcher (jax-free).

- ``setup_logging(process, level)``: stderr logging whose lines name the process.
- ``die_with_parent()``: Linux ``PR_SET_PDEATHSIG``: the kernel sends SIGTERM
  to this process when the process that started it dies (even by SIGKILL),
  so a killed launcher leaves no orphans. A no-op elsewhere.
- ``StopSignal``: turns SIGINT / SIGTERM into an event a main thread waits on.
- ``free_port(host)``: an unused TCP port to hand to a child process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
from types import FrameType

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def setup_logging(process: str, level: str = "INFO") -> None:
    """Logs to stderr as ``time LEVEL [process] logger: message``."""
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, force=True,
        format=f"%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s")


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Asks the kernel to send ``sig`` to this process when its parent dies (Linux only).

    Meant for ``subprocess.Popen(preexec_fn=die_with_parent)``: between fork
    and exec it makes one libc call (libc was loaded at import, in the
    parent). If ``parent_pid`` is given and is no longer the parent (it died
    before the call), the child exits at once.
    """
    if _LIBC is None:
        return
    _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


class StopSignal:
    """Sets ``event`` on SIGINT or SIGTERM (install from the main thread).

    Attributes:
      event: set once a stop signal arrived.
      signum: the first signal received, or None.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        self.event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once a stop signal arrived (within ``timeout`` seconds)."""
        return self.event.wait(timeout)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS's choice)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
