"""The engine replaces a dead or hung worker and the server serves again (real processes).

A tiny random-weight Llama (with the demo model's tokenizer) behind the real
launcher, api, engine and worker processes on loopback:

- **killed worker**: SIGKILL the worker mid-stream; the stream fails with
  UNAVAILABLE within 5 s, the engine starts a new worker (executables from
  the persistent compilation cache), health is SERVING again within 60 s,
  a new greedy request gives the same tokens as before the kill, every KV
  block is free, ``jaxserve_worker_restarts_total`` is 1, and shutdown
  leaves no process (the replacement worker included);
- **hung worker**: a test-only hook (``JAXSERVE_TEST_HANG_ONCE``, read by
  ``jaxserve.worker.server``) makes the first worker hang inside one step;
  after ``--step-timeout`` the engine treats it as dead: the stream fails
  with UNAVAILABLE, the hung process is killed and replaced, and the server
  serves the same greedy tokens again.

Prompts are token ids below the tiny model's vocabulary (256).
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import grpc
import pytest

from jaxserve.client import Client, JaxServeError
from jaxserve.procutil import free_port
from tests.e2e.helpers import child_pids, serve, wait_all_blocks_free, wait_gone
from tests.model.hf_tiny import copy_tokenizer, make_tiny_model

pytestmark = pytest.mark.slow

ENGINE = ("--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "128",
          "--block-size", "4", "--num-kv-blocks", "80")
PROMPT = [5, 9, 13, 17, 21, 25]
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = dict(max_tokens=100, temperature=0.0, ignore_eos=True)
SERVING_AGAIN_S = 60.0
HANG_STEP = 40  # a GREEDY request takes fewer steps; a LONG one reaches it


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, demo_model_dir):
    directory = tmp_path_factory.mktemp("tiny_llama_restart")
    make_tiny_model("LlamaForCausalLM", directory, seed=3)
    return copy_tokenizer(demo_model_dir, directory)


def _wait_serving(client: Client, timeout: float) -> float:
    """Polls health until SERVING; returns the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if client.health() == "SERVING":
                return time.monotonic() - start
        except JaxServeError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"not SERVING again within {timeout} s")


def _fails_unavailable(stream) -> float:
    """Reads ``stream`` to its end; returns when it failed (monotonic), asserting UNAVAILABLE."""
    with pytest.raises(JaxServeError) as err:
        for _ in stream:
            pass
    assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
    assert "worker" in err.value.message
    return time.monotonic()


def _restarts_metric(port: int, want: float, timeout: float = 15.0) -> float:
    """``jaxserve_worker_restarts_total`` once it reads ``want`` (stats refresh every second)."""
    deadline = time.monotonic() + timeout
    value = -1.0
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        for line in text.decode().splitlines():
            if line.startswith('jaxserve_worker_restarts_total{replica="0"} '):
                value = float(line.split()[1])
        if value == want:
            break
        time.sleep(0.2)
    return value


def test_killed_worker_is_replaced_and_the_server_serves_again(tiny_dir):
    metrics_port = free_port()
    with serve(tiny_dir, ENGINE, metrics_port=metrics_port) as launcher:
        engine_pid = launcher.processes["engine"].pid
        with Client(launcher.address, timeout=60) as client:
            before = client.generate(PROMPT, **GREEDY).token_ids
            stream = client.stream(PROMPT, **LONG)
            next(stream)
            os.kill(launcher.processes["worker"].pid, signal.SIGKILL)
            killed = time.monotonic()
            failed = _fails_unavailable(stream)
            assert failed - killed < 5.0
            took = _wait_serving(client, SERVING_AGAIN_S)
            print(f"\nkilled worker: UNAVAILABLE after {failed - killed:.2f} s, "
                  f"SERVING again {took:.1f} s later")
            assert client.generate(PROMPT, **GREEDY).token_ids == before
            free, total = wait_all_blocks_free(client)
            assert free == total
            assert _restarts_metric(metrics_port, 1.0) == 1.0
        pids = [p.pid for p in launcher.processes.values()] + child_pids(engine_pid)
        assert len(pids) == 4  # api, engine, the dead worker, its replacement
    assert wait_gone(pids) == []


def test_hung_worker_is_killed_after_the_step_timeout_and_replaced(tiny_dir, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("JAXSERVE_TEST_HANG_ONCE", f"{HANG_STEP}:{tmp_path / 'hung'}")
    with serve(tiny_dir, ENGINE + ("--step-timeout", "5")) as launcher:
        first_worker = launcher.processes["worker"]
        with Client(launcher.address, timeout=120) as client:
            before = client.generate(PROMPT, **GREEDY).token_ids  # steps before HANG_STEP
            assert not (tmp_path / "hung").exists()
            stream = client.stream(PROMPT, **LONG)
            next(stream)
            start = time.monotonic()
            failed = _fails_unavailable(stream)
            assert (tmp_path / "hung").exists()
            took = _wait_serving(client, SERVING_AGAIN_S)
            print(f"\nhung worker: UNAVAILABLE after {failed - start:.2f} s "
                  f"(--step-timeout 5), SERVING again {took:.1f} s later")
            assert first_worker.wait(30) == -signal.SIGKILL
            assert client.generate(PROMPT, **GREEDY).token_ids == before
        pids = [p.pid for p in launcher.processes.values()] + child_pids(
            launcher.processes["engine"].pid)
    assert wait_gone(pids) == []
