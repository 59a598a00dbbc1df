"""Data parallel serving end to end: ``--data-parallel-size 2`` on the demo model.

Two engine + worker replicas behind one api process (``SMALL_ENGINE`` each).
64 concurrent greedy requests through the async client give the same tokens
as ``jaxserve.LLM`` with one replica's engine configuration; both replicas
got requests (``jaxserve_replica_requests_total{replica}``); afterwards every
KV block is free on both (``jaxserve_kv_cache_usage_perc{replica}`` is 0, and
GetModelInfo, which sums the replicas, reads free == total, twice one
replica's blocks). The oracle runs after the server has stopped, so the two
workers have the CPU to themselves.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve import LLM, SamplingParams
from jaxserve.client import AsyncClient, Client
from jaxserve.procutil import free_port
from tests.e2e.helpers import SMALL_ENGINE, serve, wait_all_blocks_free

pytestmark = pytest.mark.slow

PROMPTS = ["The history of the printing press", "def add(a, b):", "Once upon a time",
           "The three primary colors are", "In 1969, astronauts", "A recipe for pancakes:",
           "Photosynthesis is the process", "Water boils at"]
NUM_REQUESTS = 64
NEW_TOKENS = 8


def _replica_samples(port: int, name: str) -> dict[str, float]:
    """replica label -> value of the per-replica metric ``name``."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {s.labels["replica"]: s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples if s.name == name}


def _wait_idle(port: int, timeout: float = 15.0) -> dict[str, float]:
    """Each replica's KV cache usage once every one reads 0 (the stats refresh each second)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = _replica_samples(port, "jaxserve_kv_cache_usage_perc")
        if (len(usage) == 2 and not any(usage.values())) or time.monotonic() > deadline:
            return usage
        time.sleep(0.2)


def test_two_replicas_share_the_work_and_match_one_replicas_greedy_tokens(demo_model_dir):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(NUM_REQUESTS)]
    metrics_port = free_port()
    with serve(demo_model_dir, SMALL_ENGINE, metrics_port=metrics_port,
               data_parallel_size=2) as launcher:
        assert {"api", "engine-0", "engine-1", "worker-0", "worker-1"} <= set(launcher.processes)
        with Client(launcher.address, timeout=60) as client:
            total_blocks = client.model_info().num_kv_blocks_total

            async def generate_all():
                async with AsyncClient(launcher.address, timeout=300) as aclient:
                    return await asyncio.gather(*(
                        aclient.generate(p, temperature=0.0, max_tokens=NEW_TOKENS,
                                         ignore_eos=True) for p in prompts))

            results = asyncio.run(generate_all())
            routed = _replica_samples(metrics_port, "jaxserve_replica_requests_total")
            assert sum(routed.values()) == NUM_REQUESTS and set(routed) == {"0", "1"}
            assert min(routed.values()) > 0, routed  # both replicas got work
            assert _wait_idle(metrics_port) == {"0": 0.0, "1": 0.0}
            free, total = wait_all_blocks_free(client)
            assert free == total == total_blocks
        running = _replica_samples(metrics_port, "jaxserve_num_requests_running")
        assert running == {"0": 0.0, "1": 0.0}
    assert all(r.usage.completion_tokens == NEW_TOKENS for r in results)
    with LLM(str(demo_model_dir), max_num_seqs=4, max_num_batched_tokens=64) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
            use_tqdm=False)]
        assert total_blocks == 2 * llm.stats().kv_blocks_total  # GetModelInfo sums
    assert [list(r.token_ids) for r in results] == [list(w) for w in want]
