"""Killing the worker process mid-run fails everything in flight within 5 s; nothing hangs.

A real worker process (``python -m jaxserve.worker.server``, a tiny
random-weight Llama) is killed with SIGKILL while steps run:

- ``EngineCore.step()`` (async scheduling: a step is always in flight)
  raises ``WorkerDiedError`` naming the worker and the signal, the core
  reports not serving, and every later call raises at once;
- the engine process's step loop (``jaxserve.engine.loop.EngineLoop``) fails
  every unfinished request in one batch;
- ``jaxserve.LLM(worker="grpc").generate`` raises instead of hanging.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from jaxserve import LLM
from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.grpc_worker import start_worker_process
from jaxserve.engine.loop import EngineLoop
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import WorkerDiedError
from tests.model.hf_tiny import make_tiny_model

DEADLINE_S = 5.0
# 400 tokens (~1 s and more): still running when the poll sees the 5th step and kills
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_death")
    make_tiny_model("LlamaForCausalLM", directory, seed=8)
    return str(directory)


def _config(model):
    return EngineConfig(
        model=model, max_model_len=512, async_scheduling=True,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                  token_buckets=(1, 4, 8, 16, 32), request_buckets=(1, 2, 4, 8)),
        cache=CacheConfig(block_size=4, num_kv_blocks=700))


def _kill_when(worker, min_steps: int) -> float:
    """SIGKILLs the worker process once it has run ``min_steps`` steps; returns the time."""
    deadline = time.monotonic() + 120
    while worker.status().num_steps < min_steps:
        assert time.monotonic() < deadline, "the worker never ran"
        time.sleep(0.02)
    os.kill(worker.process.pid, signal.SIGKILL)
    return time.monotonic()


def test_engine_core_raises_within_5_s_and_stops_serving(tiny_dir):
    worker = start_worker_process(log_level="WARNING")
    core = EngineCore(_config(tiny_dir), worker)
    for i in range(6):
        core.add_request(EngineCoreRequest(f"r{i}", [i + 1] * 10, LONG))
    outcome: dict = {}

    def run():
        try:
            while core.has_unfinished_requests():
                core.step()
            outcome["finished"] = True
        except WorkerDiedError as err:
            outcome["error"], outcome["at"] = err, time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    killed = _kill_when(worker, 5)
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "step() hung after the worker died"
    assert "error" in outcome and outcome["at"] - killed < DEADLINE_S
    message = str(outcome["error"])
    assert worker.address in message and "died" in message and "signal 9" in message
    assert not core.serving
    with pytest.raises(WorkerDiedError):
        core.step()
    with pytest.raises(WorkerDiedError):
        core.add_request(EngineCoreRequest("late", [1, 2], LONG))
    core.shutdown()  # does not hang on a dead worker


def test_engine_loop_fails_every_unfinished_request(tiny_dir):
    worker = start_worker_process(log_level="WARNING")
    failures: list[str] = []
    loop = EngineLoop(EngineCore(_config(tiny_dir), worker), on_failure=failures.append)
    outputs = loop.subscribe()
    loop.start()
    ids = {f"q{i}" for i in range(5)}
    for rid in sorted(ids):
        loop.add_request(EngineCoreRequest(rid, [3, 1, 4, 1, 5], LONG))
    killed = _kill_when(worker, 5)
    while True:
        batch = outputs.get(timeout=DEADLINE_S)
        if batch.error:
            break
    assert time.monotonic() - killed < DEADLINE_S
    assert set(batch.failed_request_ids) == ids and "WorkerDiedError" in batch.error
    assert not loop.serving and failures
    loop.stop()
    worker.shutdown()


def test_llm_generate_raises_instead_of_hanging(tiny_dir, demo_model_dir):
    llm = LLM(tiny_dir, tokenizer=str(demo_model_dir), worker="grpc", async_scheduling=True,
              max_model_len=512, max_num_seqs=8, max_num_batched_tokens=32, block_size=4,
              num_kv_blocks=700, token_buckets=(1, 4, 8, 16, 32), request_buckets=(1, 2, 4, 8))
    outcome: dict = {}

    def run():
        try:
            llm.generate([[i + 1] * 12 for i in range(6)], LONG, use_tqdm=False)
        except WorkerDiedError as err:
            outcome["error"], outcome["at"] = err, time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    killed = _kill_when(llm.engine.worker, 5)
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "LLM.generate hung after the worker died"
    assert "error" in outcome and outcome["at"] - killed < DEADLINE_S
    with pytest.raises(WorkerDiedError):
        llm.generate([[1, 2, 3]], LONG, use_tqdm=False)
    llm.shutdown()


@pytest.mark.parametrize("handle", ["process", "pid"])
def test_kill_returns_once_the_worker_process_has_exited(handle):
    """A replacement must not start while the killed worker still holds its (GPU) memory.

    A stand-in process whose command line names ``jaxserve.worker.server``
    holds 400 MB of written memory, so its exit takes a moment after SIGKILL;
    ``GrpcWorker.kill`` returns only when it is gone (reaped, or a zombie that
    freed its memory).
    """
    import subprocess
    import sys

    from jaxserve.engine.grpc_worker import GrpcWorker, _runs_worker

    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; x = b'x' * (400 << 20); "
                             "print('ready', flush=True); time.sleep(600)",
                             "jaxserve.worker.server"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        worker = (GrpcWorker("127.0.0.1:1", process=proc) if handle == "process"
                  else GrpcWorker("127.0.0.1:1", pid=proc.pid))
        worker.kill("the test is over")
        if handle == "process":
            assert proc.returncode == -signal.SIGKILL
        else:
            assert not _runs_worker(proc.pid)  # gone or a zombie: its memory is released
        with pytest.raises(WorkerDiedError, match="the test is over"):
            worker.status()
    finally:
        proc.kill()
        proc.wait()
