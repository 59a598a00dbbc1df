"""Multi-host serving end to end: ``jaxserve serve --num-worker-hosts 2 -tp 4`` on one machine.

The launcher starts two worker processes with 2 simulated CPU devices each
(their ``XLA_FLAGS``), joined by ``jax.distributed`` into one TP = 4 worker;
the engine drives them as a ``WorkerGroup``. A tiny random model (8 query
heads, 2 KV heads, the demo model's tokenizer and vocabulary).

- greedy completions through the gRPC api equal TP = 1 in this process
  (``EngineCore`` on an ``InProcessWorker``);
- SIGKILL of rank 1 mid-stream: the stream fails with UNAVAILABLE, the
  engine gives up (a group is never restarted) and the server exits; no
  worker process is left.
"""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest

from jaxserve.client import Client, JaxServeError
from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, SchedulerConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker import InProcessWorker
from tests.e2e.helpers import process_alive, serve
from tests.engine.drive import generate
from tests.model.hf_tiny import copy_tokenizer, make_tiny_model

pytestmark = pytest.mark.slow

# One sequence at a time and two T buckets: the requests below come one after another,
# and a multi-host worker compiles every executable before it is ready (no background
# compile): each R bucket is every sampler variant, each T bucket a body and prompt logprobs.
ENGINE = ("--max-num-seqs", "1", "--max-num-batched-tokens", "32", "--token-buckets", "1,32",
          "--num-kv-blocks", "128", "--block-size", "4", "--max-model-len", "128", "-tp", "4")
PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [11, 200, 31, 4], [42] * 19]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, demo_model_dir):
    directory = tmp_path_factory.mktemp("tiny_multi_host_serve")
    make_tiny_model("LlamaForCausalLM", directory, seed=6, vocab_size=49152,
                    num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    return copy_tokenizer(demo_model_dir, directory)


@pytest.fixture(scope="module")
def server(tiny_dir):
    flags = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"  # the children's
    try:
        with serve(tiny_dir, ENGINE, num_worker_hosts=2) as launcher:
            os.environ["XLA_FLAGS"] = flags or ""
            yield launcher
    finally:
        os.environ["XLA_FLAGS"] = flags or ""


def _one_device(model) -> list[list[int]]:
    config = EngineConfig(model=str(model), max_model_len=128,
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=32,
                                                    token_buckets=(1, 32)),
                          cache=CacheConfig(block_size=4, num_kv_blocks=128))
    core = EngineCore(config, InProcessWorker(progress=False))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = generate(core, PROMPTS, params)
    core.shutdown()
    return [tokens[f"r{i}"] for i in range(len(PROMPTS))]


def test_greedy_tokens_match_one_device_then_a_dead_rank_stops_the_server(server, tiny_dir):
    assert {"worker-h0", "worker-h1"} <= set(server.processes)
    with Client(server.address) as client:
        got = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0,
                               ignore_eos=True).token_ids for p in PROMPTS]
        assert [list(t) for t in got] == _one_device(tiny_dir)

        errors: list[JaxServeError] = []
        streaming = threading.Event()

        def stream():
            try:
                for _ in client.stream([1, 2, 3], max_tokens=120, ignore_eos=True):
                    streaming.set()
            except JaxServeError as err:
                errors.append(err)

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        # killed once the stream has begun, with ~119 of its 120 tokens still to come
        assert streaming.wait(60)
        os.kill(server.processes["worker-h1"].pid, signal.SIGKILL)
        thread.join(10.0)
        assert not thread.is_alive() and errors
        assert errors[0].code == grpc.StatusCode.UNAVAILABLE
    assert server.wait() == 1  # the engine gave up: no restart for a group
    pids = [p.pid for name, p in server.processes.items() if name.startswith("worker")]
    server.shutdown()
    assert not any(process_alive(pid) for pid in pids)
