"""Starts ``jaxserve serve`` as a subprocess for the serving benchmark, and stops it.

The server's own launcher supervises its worker, engine and api processes;
we start the launcher (``python -m jaxserve serve``) on a free loopback port,
poll the standard gRPC health service until it says ``SERVING`` (or the
process exits: its log tail is raised), and stop it with SIGINT, as a
terminal's Ctrl-C would (SIGKILL only if it has not exited after a grace
period). Its stdout and stderr go to a log file.
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)


class ServerProcess:
    """A ``jaxserve serve`` child process; a context manager (``start`` ... ``stop``).

    Args:
      serve_args: extra ``jaxserve serve`` flags (``--max-num-seqs 16``, ...).
      log_path: file for the server's output.
    """

    def __init__(self, serve_args: Sequence[str], log_path: str | os.PathLike,
                 host: str = "127.0.0.1"):
        from jaxserve.procutil import free_port

        self.port = free_port(host)
        self.target = f"{host}:{self.port}"
        self.http_port = free_port(host)
        self.base_url = f"http://{host}:{self.http_port}"  # the OpenAI-compatible HTTP API
        self.log_path = pathlib.Path(log_path)
        self.cmd = [sys.executable, "-m", "jaxserve", "serve", "--host", host,
                    "--port", str(self.port), "--http-port", str(self.http_port),
                    "--metrics-port", "0", *serve_args]
        self.proc: subprocess.Popen | None = None
        self.ready_seconds: float | None = None

    def start(self, timeout: float = 900.0) -> "ServerProcess":
        """Starts the server and waits until it is serving.

        Raises:
          RuntimeError: the server exited, or was not serving within ``timeout`` s.
        """
        from jaxserve.client import Client, JaxServeError

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        logger.info("starting %s (log %s)", " ".join(self.cmd), self.log_path)
        start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        log.close()
        with Client(self.target, timeout=2.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"jaxserve serve exited with {self.proc.returncode}:\n"
                                       f"{self.log_tail()}")
                if time.perf_counter() - start > timeout:
                    self.stop()
                    raise RuntimeError(f"jaxserve serve not serving after {timeout} s:\n"
                                       f"{self.log_tail()}")
                try:
                    if client.health() == "SERVING":
                        break
                except JaxServeError:
                    pass
                time.sleep(0.5)
        self.ready_seconds = time.perf_counter() - start
        logger.info("server ready on %s after %.1f s", self.target, self.ready_seconds)
        return self

    def stop(self, grace: float = 60.0) -> int | None:
        """SIGINT, then SIGKILL after ``grace`` seconds; returns the exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                logger.warning("server did not stop within %.0f s: killing it", grace)
                proc.kill()
                proc.wait()
        return proc.returncode

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
