"""A long worker error keeps its cause across every process hop, bounded (real processes).

A test-only hook (``JAXSERVE_TEST_FAIL_ONCE``, read by
``jaxserve.worker.server``) makes the first worker process raise a
50,000-character ``RuntimeError`` in ``initialize`` or in one step. gRPC
refuses status details over 16 KiB ("received metadata size exceeds hard
limit", which hides the cause), so every hop sends the error's type and first
lines, at most ``MAX_DETAILS_BYTES`` (2 KiB), and the worker's log keeps the
whole text:

- **initialize**: ``GrpcWorker.initialize`` (what the engine calls) and
  ``jaxserve.LLM(worker="grpc")`` raise a ``RuntimeError`` naming the
  worker's error; the served engine logs it and exits, and the launcher
  reports the engine's exit;
- **a step**: the client's call fails with UNAVAILABLE and a message naming
  the worker's error (worker -> engine -> api -> client); the engine's log
  names it too.

A tiny random-weight Llama (with the demo model's tokenizer) behind the real
launcher, api, engine and worker processes on loopback.
"""

from __future__ import annotations

import re

import grpc
import pytest

from jaxserve import LLM
from jaxserve.client import Client, JaxServeError
from jaxserve.launcher import ServerExited
from jaxserve.status_details import MAX_DETAILS_BYTES
from jaxserve.worker.server import TEST_FAIL_ENV, TEST_FAIL_LAST_LINE
from tests.e2e.helpers import serve
from tests.model.hf_tiny import copy_tokenizer, make_tiny_model

pytestmark = pytest.mark.slow

ENGINE = ("--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "128",
          "--block-size", "4", "--num-kv-blocks", "80")  # as test_worker_restart: shared compiles
PROMPT = [5, 9, 13, 17, 21, 25]
FAIL_STEP = 5
# What a hop may add around the worker's bounded details ("worker at HOST:PORT: ...").
HOP_PREFIX_BYTES = 200


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, demo_model_dir):
    directory = tmp_path_factory.mktemp("tiny_llama_errors")
    make_tiny_model("LlamaForCausalLM", directory, seed=4)
    return copy_tokenizer(demo_model_dir, directory)


def _first_line(what: str) -> str:
    return f"test failure in {what} ({TEST_FAIL_ENV})"


def _last_line() -> str:
    """The end of the 50,000-character error: only the worker's log has it."""
    return TEST_FAIL_LAST_LINE


def _names_the_error(message: str, what: str, limit: int) -> None:
    assert f"{what}: RuntimeError: {_first_line(what)}" in message, message[:500]
    assert len(message.encode()) <= limit, len(message.encode())
    assert _last_line() not in message


def _log_record(log: str, process: str, needle: str) -> str:
    """The record of ``process``'s log that contains ``needle`` (up to the next record)."""
    records = re.split(r"\n(?=\S+ \S+ [A-Z]+ \[)", log)
    found = [r for r in records if f"[{process}]" in r.split("\n")[0] and needle in r]
    assert found, f"no {process} log record names {needle!r}"
    return found[0]


def _engine_error(log: str, what: str) -> str:
    """The worker's error as the engine's log states it (after any traceback of its own)."""
    record = _log_record(log, "engine", _first_line(what))
    return record[record.rindex("RuntimeError: worker at "):]


def test_a_long_initialize_error_is_named_and_bounded(tiny_dir, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(TEST_FAIL_ENV, f"initialize:{tmp_path / 'llm'}")
    with pytest.raises(RuntimeError) as err:
        LLM(str(tiny_dir), worker="grpc", max_model_len=128)
    _names_the_error(str(err.value), "initialize", MAX_DETAILS_BYTES + HOP_PREFIX_BYTES)
    assert _last_line() in capfd.readouterr().err  # the worker's log keeps the whole text

    monkeypatch.setenv(TEST_FAIL_ENV, f"initialize:{tmp_path / 'served'}")
    with pytest.raises(ServerExited, match="engine"):
        with serve(tiny_dir, ENGINE):
            pass
    log = capfd.readouterr().err
    assert "engine failed to start: RuntimeError: worker at " in log
    _names_the_error(_engine_error(log, "initialize"), "initialize",
                     MAX_DETAILS_BYTES + HOP_PREFIX_BYTES)
    assert _last_line() in _log_record(log, "worker", _first_line("initialize"))


def test_a_long_step_error_is_named_and_bounded(tiny_dir, tmp_path, monkeypatch, capfd):
    what = f"step {FAIL_STEP}"
    monkeypatch.setenv(TEST_FAIL_ENV, f"{what}:{tmp_path / 'step'}")
    with serve(tiny_dir, ENGINE) as launcher:
        with Client(launcher.address, timeout=120) as client:
            with pytest.raises(JaxServeError) as err:
                client.generate(PROMPT, max_tokens=3 * FAIL_STEP, ignore_eos=True)
    assert (tmp_path / "step").exists()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
    _names_the_error(err.value.message, what, MAX_DETAILS_BYTES)
    log = capfd.readouterr().err
    _names_the_error(_engine_error(log, what), what, MAX_DETAILS_BYTES + HOP_PREFIX_BYTES)
    assert _last_line() in _log_record(log, "worker", _first_line(what))
