"""Data parallel serving end to end: ``--data-parallel-size 2``.

One server for the module: two engine + worker replicas behind one api
process (``SMALL_ENGINE`` each) on ``small_model_dir`` (a random-weight Llama
with the demo model's tokenizer).

- 64 concurrent greedy requests (the 8 ``PROMPTS``, 8 times each) through
  the async client give the same tokens as ``jaxserve.LLM`` with one
  replica's engine configuration gives each prompt; both
  replicas got requests (``jaxserve_replica_requests_total{replica}``);
  afterwards every KV block is free on both
  (``jaxserve_kv_cache_usage_perc{replica}`` is 0, and GetModelInfo, which
  sums the replicas, reads free == total, twice one replica's blocks).
- SIGKILL replica 1's worker mid-stream: its stream fails with UNAVAILABLE,
  replica 0's stream finishes, the server stays SERVING and new requests go
  to replica 0; once replica 1's engine has a new worker, requests go to it
  again (``jaxserve_worker_restarts_total{replica="1"}`` is 1).
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve import LLM, SamplingParams
from jaxserve.client import Client, JaxServeError
from jaxserve.procutil import free_port
from tests.e2e.helpers import (PROMPTS, SMALL_ENGINE, generate_concurrently, serve,
                               wait_all_blocks_free)

pytestmark = pytest.mark.slow

NUM_REQUESTS = 64
NEW_TOKENS = 8
LONG = dict(max_tokens=1000, temperature=0.0, ignore_eos=True)  # still running at the kill
SERVING_AGAIN_S = 120.0


def _replica_samples(port: int, name: str) -> dict[str, float]:
    """replica label -> value of the per-replica metric ``name``."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {s.labels["replica"]: s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples if s.name == name}


def _wait_metric(port: int, name: str, want: dict[str, float],
                 timeout: float = 15.0) -> bool:
    """Whether the per-replica metric ``name`` reads ``want`` within ``timeout`` seconds
    (the engine metrics refresh once a second)."""
    deadline = time.monotonic() + timeout
    while _replica_samples(port, name) != want:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def server(small_model_dir):
    with serve(small_model_dir, SMALL_ENGINE, metrics_port=free_port(),
               data_parallel_size=2) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120) as c:
        yield c



def test_two_replicas_share_the_work_and_match_one_replicas_greedy_tokens(
        server, client, small_model_dir):
    assert {"api", "engine-0", "engine-1", "worker-0", "worker-1"} <= set(server.processes)
    port = server.options.metrics_port
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(NUM_REQUESTS)]
    total_blocks = client.model_info().num_kv_blocks_total
    results = generate_concurrently(server.address, prompts, temperature=0.0,
                                     max_tokens=NEW_TOKENS, ignore_eos=True)
    assert all(r.usage.completion_tokens == NEW_TOKENS for r in results)
    routed = _replica_samples(port, "jaxserve_replica_requests_total")
    assert sum(routed.values()) == NUM_REQUESTS and set(routed) == {"0", "1"}
    assert min(routed.values()) > 0, routed  # both replicas got work
    assert _wait_metric(port, "jaxserve_kv_cache_usage_perc", {"0": 0.0, "1": 0.0})
    assert _replica_samples(port, "jaxserve_num_requests_running") == {"0": 0.0, "1": 0.0}
    free, total = wait_all_blocks_free(client)
    assert free == total == total_blocks
    with LLM(str(small_model_dir), max_num_seqs=4, max_num_batched_tokens=64) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
            use_tqdm=False)]
        assert total_blocks == 2 * llm.stats().kv_blocks_total  # GetModelInfo sums
    assert [list(r.token_ids) for r in results] == [want[i % len(PROMPTS)]
                                                      for i in range(NUM_REQUESTS)]


def test_a_failed_replica_is_routed_around_until_it_serves_again(server, client):
    port = server.options.metrics_port
    routed = _replica_samples(port, "jaxserve_replica_requests_total")
    on_0 = client.stream(PROMPTS[0], **LONG)
    next(on_0)  # nothing else in flight: replica 0
    on_1 = client.stream(PROMPTS[1], **LONG)
    next(on_1)  # replica 0 has one in flight: replica 1
    after = _replica_samples(port, "jaxserve_replica_requests_total")
    assert (after["0"] - routed["0"], after["1"] - routed["1"]) == (1, 1)
    os.kill(server.processes["worker-1"].pid, signal.SIGKILL)
    with pytest.raises(JaxServeError) as err:
        for _ in on_1:
            pass
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "worker" in err.value.message
    deltas = list(on_0)  # replica 0 is unaffected
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 1000
    assert client.health() == "SERVING"
    routed = _replica_samples(port, "jaxserve_replica_requests_total")
    short = client.generate(PROMPTS[2], max_tokens=2, ignore_eos=True)
    assert short.usage.completion_tokens == 2
    after = _replica_samples(port, "jaxserve_replica_requests_total")
    assert (after["0"] - routed["0"], after["1"] - routed["1"]) == (1, 0)
    # Replica 1 serves again on a new worker: two concurrent requests split again.
    deadline = time.monotonic() + SERVING_AGAIN_S
    while True:
        routed = _replica_samples(port, "jaxserve_replica_requests_total")
        generate_concurrently(server.address, PROMPTS[:2], max_tokens=4, temperature=0.0)
        after = _replica_samples(port, "jaxserve_replica_requests_total")
        if after["1"] > routed["1"]:
            break
        assert time.monotonic() < deadline, "replica 1 did not serve again"
        time.sleep(1.0)
    assert _wait_metric(port, "jaxserve_worker_restarts_total", {"0": 0.0, "1": 1.0})
    free, total = wait_all_blocks_free(client)
    assert free == total
