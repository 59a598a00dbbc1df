"""Tensor parallel serving end to end: ``jaxserve serve --tensor-parallel-size 3``.

``small_model_dir`` (a random-weight Llama with the demo model's tokenizer and
head counts: 9 query heads, 3 KV heads) split over three of the four
simulated CPU devices every test process has (tests/conftest.py; the server
processes inherit ``XLA_FLAGS``), one KV head per device. Eight concurrent
requests, greedy and seeded sampling, give the same tokens as
``jaxserve.LLM`` on one device with the same engine limits, and afterwards
every KV block is free.
"""

from __future__ import annotations


import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.client import Client
from tests.e2e.helpers import (PROMPTS, SMALL_ENGINE, generate_concurrently, serve,
                               wait_all_blocks_free)

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
SAMPLED = dict(temperature=0.8, top_p=0.95, seed=11, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def server(small_model_dir):
    with serve(small_model_dir, SMALL_ENGINE + ("--tensor-parallel-size", "3")) as launcher:
        yield launcher



def test_tp3_server_matches_one_device(server, small_model_dir):
    greedy = generate_concurrently(server.address, PROMPTS, **GREEDY)
    sampled = generate_concurrently(server.address, PROMPTS, **SAMPLED)
    with LLM(str(small_model_dir), max_num_seqs=4, max_num_batched_tokens=64) as llm:
        want = [[list(o.outputs[0].token_ids) for o in llm.generate(
            PROMPTS, SamplingParams(**params), use_tqdm=False)] for params in (GREEDY, SAMPLED)]
    assert [list(r.token_ids) for r in greedy] == want[0]
    assert [list(r.token_ids) for r in sampled] == want[1]
    with Client(server.address, timeout=60) as client:
        free, total = wait_all_blocks_free(client)
    assert free == total
