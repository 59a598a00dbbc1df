"""The demo model gives identical greedy outputs in process and over gRPC, async on and off.

The same 32 requests (16 share a 64-token system prompt, so prefix caching
and mixed prefill + decode steps happen) through ``jaxserve.LLM`` four ways:
in-process worker with synchronous scheduling (the reference), in-process
with async scheduling, and a worker process over gRPC with each mode. Greedy
token ids must be equal, token for token; the recompile guard is strict
throughout. Outputs are 8 tokens to keep the module short.
"""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.grpc_worker import start_worker_process
from jaxserve.model.loader import load_model
from jaxserve.worker import InProcessWorker
from tests.demo_prompts import QUESTIONS, TEXTS

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
ARGS = dict(max_num_seqs=32, max_model_len=256, num_kv_blocks=320, block_size=16,
            max_num_batched_tokens=64, token_buckets=(1, 4, 8, 16, 32, 64),
            strict_recompile=True)


def _prompts(tokenizer) -> list[list[int]]:
    system = tokenizer.encode(" ".join(["You are a careful assistant who answers briefly and "
                                        "politely, citing facts only when sure."] * 4))[:64]
    out = []
    for q, t in zip(QUESTIONS, TEXTS):
        out.append(system + tokenizer.encode(" " + q))
        out.append(tokenizer.encode(t))
    return out


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_in_process_and_grpc_with_and_without_async_agree(demo_model_dir):
    loaded = load_model(demo_model_dir, "float32")
    reference_llm = LLM(str(demo_model_dir), worker=InProcessWorker(loaded, progress=False),
                        **ARGS)
    prompts = _prompts(reference_llm.get_tokenizer())
    reference = _tokens(reference_llm, prompts)
    assert len(reference) == 32 and sum(len(t) for t in reference) > 200
    assert any(len(t) < 8 for t in reference)  # some stop at EOS: async drops their next step
    assert reference_llm.stats().prefix_cache_hits > 0
    async_llm = LLM(str(demo_model_dir), worker=InProcessWorker(loaded, progress=False),
                    async_scheduling=True, **ARGS)
    assert _tokens(async_llm, prompts) == reference
    reference_llm.shutdown()  # and their background compiles
    async_llm.shutdown()
    worker = start_worker_process(log_level="WARNING")
    try:
        for async_scheduling in (False, True):
            # Each LLM re-initializes the same worker process.
            llm = LLM(str(demo_model_dir), worker=worker, async_scheduling=async_scheduling,
                      **ARGS)
            assert _tokens(llm, prompts) == reference, f"grpc, async={async_scheduling}"
            assert worker.status().num_recompiles == 0
    finally:
        worker.shutdown()
