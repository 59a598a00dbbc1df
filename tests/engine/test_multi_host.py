"""Multi-host tensor parallelism on one machine: two worker processes, one JAX job.

Two ``python -m jaxserve.worker.server --num-hosts 2 --host-rank r`` processes
on loopback, each with 2 simulated CPU devices (their own ``XLA_FLAGS``),
joined by ``jax.distributed`` over gloo: TP = 4 spans both. The engine drives
them through ``WorkerGroup`` (every plan to both ranks, rank 0's tokens).

- greedy tokens of TP = 4 across the two processes equal TP = 1 (an
  ``InProcessWorker`` on one device in this process), on a tiny random
  model with 8 query heads and 2 KV heads (TP = 4 replicates each KV head on
  two devices, one per process);
- killing one rank mid-run fails the step in flight with ``WorkerDiedError``
  within ``DEADLINE_S`` and leaves no worker process behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.worker_group import start_worker_group
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import WorkerDiedError
from jaxserve.worker import InProcessWorker
from tests.engine.drive import generate
from tests.model.hf_tiny import make_tiny_model

DEADLINE_S = 5.0
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [11, 200, 31, 4], [42] * 19, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_multi_host")
    make_tiny_model("LlamaForCausalLM", directory, seed=5, num_attention_heads=8,
                    num_key_value_heads=2, intermediate_size=128)
    return str(directory)


def _config(model: str, tp: int) -> EngineConfig:
    return EngineConfig(
        model=model, max_model_len=128, async_scheduling=True, tensor_parallel_size=tp,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                  token_buckets=(32,), request_buckets=(4,)),
        cache=CacheConfig(block_size=4, num_kv_blocks=128))


def _gone(proc) -> bool:
    try:
        proc.wait(timeout=DEADLINE_S)
    except Exception:  # noqa: BLE001 - still running
        return False
    return True


@pytest.fixture(scope="module")
def group_core(tiny_dir):
    """One TP = 4 group for the module (rank 1 compiles every start: see docs/scale_out.md)."""
    group = start_worker_group(2, env=TWO_DEVICES, log_level="WARNING")
    try:
        yield group, EngineCore(_config(tiny_dir, 4), group)
    finally:
        group.kill("the test is over")
        group.shutdown()


def test_tp4_over_two_processes_matches_one_device(tiny_dir, group_core):
    group, core = group_core
    got = generate(core, PROMPTS, GREEDY)
    assert group.status().num_steps == core.num_steps
    one = EngineCore(_config(tiny_dir, 1), InProcessWorker(progress=False))
    expected = generate(one, PROMPTS, GREEDY)
    one.shutdown()
    assert all(len(t) == GREEDY.max_tokens for t in expected.values())
    assert got == expected


def test_killing_one_rank_fails_the_step_and_stops_the_other(group_core):
    group, core = group_core
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    for i in range(4):
        core.add_request(EngineCoreRequest(f"k{i}", [i + 1] * 9, long))
    outcome: dict = {}

    def run():
        try:
            while core.has_unfinished_requests():
                core.step()
        except WorkerDiedError as err:
            outcome["error"], outcome["at"] = err, time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    steps = group.workers[0].status().num_steps
    while group.workers[0].status().num_steps < steps + 3:
        time.sleep(0.02)
    victim = group.workers[1]
    os.kill(victim.process.pid, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "step() hung after a rank died"
    assert "error" in outcome and outcome["at"] - killed < DEADLINE_S
    assert victim.address in str(outcome["error"]) and "signal 9" in str(outcome["error"])
    assert not core.serving and group.dead
    with pytest.raises(WorkerDiedError):
        core.step()
    core.shutdown()  # does not hang on a dead group
    assert all(_gone(w.process) for w in group.workers), "a worker process was left behind"
