"""The middle sampler variants compile after start-up; until then a covering variant serves.

A worker is ready with the GREEDY and FULL samplers of every R; SAMPLED and
PROCESSED compile in a background thread. A step whose rows need one that is
not compiled yet runs the cheapest compiled variant covering it — FULL at
worst — with the same tokens (FULL matches every variant on the rows it
covers, bit for bit). The oracle: the same seeded requests on a worker that
has every variant. Neither run compiles anything in a step (strict guard).
"""

from __future__ import annotations

import pytest

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.config import CompileConfig
from jaxserve.model.loader import load_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker import InProcessWorker
from jaxserve.worker.executables import BACKGROUND_VARIANTS, variant_name
from tests.model.hf_tiny import make_tiny_model

R_LADDER = (1, 2, 4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_variants")
    make_tiny_model("LlamaForCausalLM", directory, seed=5)
    return load_model(directory, "float32")


def _run(tiny, drop_background: bool) -> tuple[dict, InProcessWorker]:
    config = EngineConfig(
        max_model_len=64, seed=11,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                  token_buckets=(1, 4, 16), request_buckets=R_LADDER),
        cache=CacheConfig(block_size=4, num_kv_blocks=64),
        compile=CompileConfig(strict_recompile=True))
    worker = InProcessWorker(tiny, progress=False)
    engine = EngineCore(config, worker)
    worker.background_compile.join()
    later = {variant_name(v) for v in BACKGROUND_VARIANTS}
    assert all(f"sampler[R={r},{name}]" in worker.functions for r in R_LADDER for name in later)
    if drop_background:  # as if the background thread had not finished yet
        for r in R_LADDER:
            for name in later:
                del worker.functions[f"sampler[R={r},{name}]"]
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True),  # SAMPLED
              SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=6,
                             ignore_eos=True),  # SAMPLED
              SamplingParams(temperature=0.9, presence_penalty=0.5, seed=3, max_tokens=6,
                             ignore_eos=True)]  # PROCESSED
    for i, p in enumerate(params):
        engine.add_request(EngineCoreRequest(f"r{i}", [3 + i, 7, 11, 2 * i + 1], p))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert worker.guard.num_recompiles == 0
    engine.shutdown()
    return tokens, worker


def test_a_variant_not_yet_compiled_is_served_by_a_covering_one_with_the_same_tokens(tiny):
    expected, full_worker = _run(tiny, drop_background=False)
    got, early_worker = _run(tiny, drop_background=True)
    later = {variant_name(v) for v in BACKGROUND_VARIANTS}
    assert later & set(full_worker.executed_variants), full_worker.executed_variants
    assert not later & set(early_worker.executed_variants), early_worker.executed_variants
    assert got == expected
    assert all(len(t) == 6 for t in got.values())


def test_a_worker_dropped_without_shutdown_frees_its_executables(tiny):
    """Nothing process-wide (an atexit entry of the background compile) keeps a
    worker's executables alive once the worker is dropped: each XLA:CPU
    executable maps memory regions, and a process that leaked every dropped
    engine's reached Linux's map limit and died loading the next one."""
    import gc
    import weakref

    config = EngineConfig(
        max_model_len=64, seed=11,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                  token_buckets=(1, 4, 16), request_buckets=R_LADDER),
        cache=CacheConfig(block_size=4, num_kv_blocks=64))
    worker = InProcessWorker(tiny, progress=False)
    engine = EngineCore(config, worker)
    worker.background_compile.join()
    dropped = weakref.ref(worker)
    executables = [weakref.ref(f.compiled) for f in worker.functions.values()]
    del engine, worker
    gc.collect()
    assert dropped() is None
    assert executables and all(ref() is None for ref in executables)
