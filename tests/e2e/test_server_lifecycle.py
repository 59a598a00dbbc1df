"""Start-up, shutdown and failure of the real server processes (the demo command's limits).

- The worker process dies mid-generation with ``--max-worker-restarts 0``:
  the running stream fails with UNAVAILABLE naming the worker within 5 s,
  the engine gives up and exits with status 1, the api reports NOT_SERVING
  and refuses new requests, ``Launcher.wait`` returns 1; shutdown leaves no
  process behind. (Restarts: tests/e2e/test_worker_restart.py.)
- ``jaxserve serve`` drains on SIGTERM, sent to the launcher or to every
  process at once: 8 requests in flight all finish with "length", a request
  sent after the signal gets UNAVAILABLE (HTTP 503), exit status 0, no
  process left.
- With ``--shutdown-grace 0`` on SIGTERM, or on a second Ctrl-C (SIGINT)
  during the drain, it aborts the stream in flight (finish reason "abort"):
  exit status 0, no process left.
- A SIGKILLed ``jaxserve serve`` leaves no orphans (the children die with it).
- ``jaxserve demo`` prints a streamed answer and exits 0, leaving nothing.

Each test starts its own server (they end it), so this module costs
several start-ups: all but the demo command's serve ``small_model_dir`` (a
random-weight Llama with the demo model's tokenizer), whose start-up and steps
cost a fraction of the demo model's, and load the step executables from the
persistent compilation cache shared by the test session.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.client import Client, JaxServeError
from jaxserve.procutil import free_port
from tests.e2e.helpers import DEMO_ENGINE, READY_TIMEOUT_S, child_pids, serve, wait_gone

pytestmark = pytest.mark.slow

LONG = dict(max_tokens=2000, ignore_eos=True, temperature=0.0)
# Long enough that the eight drained requests (one at a time) are all in flight before
# the first finishes, at the small model's few milliseconds a step.
DRAINED_TOKENS = 200


def test_worker_death_without_restarts_stops_the_server(small_model_dir):
    with serve(small_model_dir, DEMO_ENGINE + ("--max-worker-restarts", "0")) as launcher:
        pids = [p.pid for p in launcher.processes.values()]
        with Client(launcher.address, timeout=60) as client:
            stream = client.stream("Tell me a long story.", **LONG)
            next(stream)
            os.kill(launcher.processes["worker"].pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(JaxServeError) as err:
                for _ in stream:
                    pass
            assert time.monotonic() - killed < 5.0
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert "worker" in err.value.message and "died" in err.value.message
            assert launcher.processes["engine"].wait(30) == 1  # gave up
            assert launcher.wait() == 1
            assert client.health() == "NOT_SERVING"
            with pytest.raises(JaxServeError) as err:
                client.generate("Anyone there?", max_tokens=2)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert wait_gone(pids) == []


def _start_cli(model_dir: pathlib.Path, command: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "--log-level", "WARNING", command, "--model",
         str(model_dir), *DEMO_ENGINE, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_serving(proc: subprocess.Popen, address: str) -> list[int]:
    """Waits until the CLI's server is SERVING; returns the launcher's children."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with Client(address, timeout=5) as client:
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            try:
                if client.health() == "SERVING":
                    children = child_pids(proc.pid)
                    assert len(children) == 3, children
                    return children
            except JaxServeError:
                pass
            time.sleep(0.25)
    raise AssertionError("the server did not start")


def _in_flight(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        for family in text_string_to_metric_families(r.read().decode()):
            if family.name == "jaxserve_num_sequences_in_flight":
                return family.samples[0].value
    raise AssertionError("no jaxserve_num_sequences_in_flight gauge")


@pytest.mark.parametrize("everyone", [False, True], ids=["launcher", "every-process"])
def test_sigterm_drains_running_requests(small_model_dir, everyone):
    """SIGTERM to the launcher, or to every process at once (systemd's KillMode=control-group)."""
    port, http_port, metrics_port = free_port(), free_port(), free_port()
    # The grace is a bound, not what is tested: on a busy machine the default 30 s has
    # not been enough for the eight requests (one at a time) to finish.
    proc = _start_cli(small_model_dir, "serve", "--port", str(port), "--metrics-port",
                      str(metrics_port), "--http-port", str(http_port), "--shutdown-grace", "300")
    try:
        children = _wait_serving(proc, f"127.0.0.1:{port}")
        with Client(f"127.0.0.1:{port}", timeout=120) as client:
            results: list = [None] * 8

            def consume(i: int) -> None:
                try:
                    results[i] = list(client.stream(f"Count to {i}:", max_tokens=DRAINED_TOKENS,
                                                    ignore_eos=True, temperature=0.0))[-1]
                except JaxServeError as err:
                    results[i] = err

            threads = [threading.Thread(target=consume, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while _in_flight(metrics_port) < 8 and time.monotonic() < deadline:
                time.sleep(0.02)  # one runs (max_num_seqs 1), seven wait
            for pid in [proc.pid, *(children if everyone else [])]:
                os.kill(pid, signal.SIGTERM)
            while client.health() == "SERVING" and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(JaxServeError) as err:
                client.generate("Too late", max_tokens=2)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(urllib.error.HTTPError) as http_err:
                urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10)
            assert http_err.value.code == 503
            for t in threads:
                t.join(120)
        assert [getattr(r, "finish_reason", r) for r in results] == ["length"] * 8
        assert proc.wait(60) == 0, proc.communicate()[1][-3000:]
        assert wait_gone(children) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("signals,grace", [([signal.SIGTERM], "0"),
                                           ([signal.SIGINT, signal.SIGINT], "300")],
                         ids=["SIGTERM-no-grace", "Ctrl-C-twice"])
def test_serve_aborts_without_grace_or_on_a_second_ctrl_c(small_model_dir, signals, grace):
    port, metrics_port = free_port(), free_port()
    proc = _start_cli(small_model_dir, "serve", "--port", str(port), "--metrics-port",
                      str(metrics_port), "--http-port", str(free_port()),
                      "--shutdown-grace", grace)
    try:
        children = _wait_serving(proc, f"127.0.0.1:{port}")
        deltas: list = []
        failure: list = []

        def consume():
            try:
                with Client(f"127.0.0.1:{port}", timeout=60) as client:
                    deltas.extend(client.stream("Write a long poem about the sea.", **LONG))
            except JaxServeError as err:
                failure.append(err)

        reader = threading.Thread(target=consume)
        reader.start()
        deadline = time.monotonic() + 60
        while len(deltas) < 2 and time.monotonic() < deadline and reader.is_alive():
            time.sleep(0.05)
        assert len(deltas) >= 2, failure
        for sig in signals:
            n = len(deltas)
            proc.send_signal(sig)
            while len(deltas) < n + 2 and reader.is_alive():  # the stream goes on: draining
                time.sleep(0.05)
        assert proc.wait(60) == 0, proc.communicate()[1][-3000:]
        reader.join(30)
        assert not failure, failure
        assert deltas[-1].finish_reason == "abort"
        assert wait_gone(children) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_killed_launcher_leaves_no_orphans(small_model_dir):
    port = free_port()
    proc = _start_cli(small_model_dir, "serve", "--port", str(port), "--metrics-port", "0",
                      "--no-http")
    try:
        children = _wait_serving(proc, f"127.0.0.1:{port}")
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(children) == []


def test_demo_prints_a_streamed_answer_and_exits(demo_model_dir):
    proc = _start_cli(demo_model_dir, "demo")
    out, err = proc.communicate(timeout=READY_TIMEOUT_S)
    assert proc.returncode == 0, err[-3000:]
    assert "assistant:" in out and "Paris" in out.split("assistant:", 1)[1], out
