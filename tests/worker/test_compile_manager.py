"""Every executable compiled at start-up, none after: the compile manager and its guard.

The oracle for "no compile" is JAX itself: ``jax.monitoring`` reports every
XLA executable JAX obtains (compiled or loaded from the persistent cache),
counted process-wide by ``compile_manager.COUNTER`` — so the 500-request run
below passes only if not one step, on any thread, needed a new executable.
The model is a tiny random-weight Llama (tests/model/hf_tiny.py); requests
mix every sampling feature, n > 1, aborts, chunked prefill and preemption.
"""

from __future__ import annotations

import random
import threading
import time

import jax
import numpy as np
import pytest

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.config import CompileConfig
from jaxserve.model.loader import load_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import RecompileError
from jaxserve.worker import InProcessWorker
from jaxserve.worker.compile_manager import (COUNTER, BackgroundCompile, RecompileGuard,
                                             StepExecutable, Tally)
from jaxserve.worker.executables import BACKGROUND_VARIANTS
from jaxserve.worker.sampler import COMPILED_VARIANTS
from tests.model.hf_tiny import make_tiny_model
from tests.worker.engine_runs import join_background_compiles

VOCAB = 256
T_LADDER, R_LADDER = (1, 4, 8, 16, 32, 64), (1, 2, 4, 8, 16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_compile")
    make_tiny_model("LlamaForCausalLM", directory, seed=9)
    return load_model(directory, "float32")


def _random_params(rng: random.Random, i: int) -> SamplingParams:
    max_tokens = rng.randrange(1, 24)
    return SamplingParams(
        n=rng.choice([1, 1, 1, 2, 3]), temperature=rng.choice([0.0, 0.6, 1.0]),
        top_k=rng.choice([0, 0, 7]), top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0.0, 0.1]),
        seed=rng.choice([None, i]), repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
        presence_penalty=rng.choice([0.0, 0.5]), frequency_penalty=rng.choice([0.0, -0.3]),
        logit_bias=rng.choice([None, {rng.randrange(VOCAB): 3.0}]),
        logprobs=rng.choice([None, None, 0, 2, 20]), max_tokens=max_tokens,
        min_tokens=rng.choice([0, min(2, max_tokens)]),
        stop_token_ids=rng.choice([None, [rng.randrange(VOCAB)]]), ignore_eos=rng.random() < 0.5)


def test_500_random_requests_compile_nothing_after_warm_up(tiny):
    config = EngineConfig(
        max_model_len=128, seed=3, async_scheduling=True,
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64,
                                  token_buckets=T_LADDER, request_buckets=R_LADDER),
        cache=CacheConfig(block_size=4, num_kv_blocks=160),
        compile=CompileConfig(strict_recompile=True))
    worker = InProcessWorker(tiny, progress=False)
    engine = EngineCore(config, worker)
    report = worker.compile_report
    # Before ready: GREEDY and FULL samplers; the middle variants in the background.
    assert report.by_kind == {"body": len(T_LADDER),
                              "sampler": (len(COMPILED_VARIANTS) - len(BACKGROUND_VARIANTS))
                              * len(R_LADDER), "rows": len(R_LADDER) + 1}
    join_background_compiles()  # this worker's, and any other's of this process
    samplers = [name for name in worker.functions if name.startswith("sampler[")]
    # The step executables: |T| + |variants| x |R|, not a product with T.
    assert len(samplers) == len(COMPILED_VARIANTS) * len(R_LADDER)
    assert report.by_kind["body"] + len(samplers) < (
        len(T_LADDER) * len(R_LADDER) * len(COMPILED_VARIANTS))
    compiles_after_warm_up = COUNTER.compiles
    rng = random.Random(500)
    finished, submitted, step = set(), 0, 0
    while submitted < 500 or engine.has_unfinished_requests():
        if submitted < 500 and step % 3 == 0:
            for _ in range(rng.randrange(1, 6)):
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 100))]
                engine.add_request(EngineCoreRequest(f"r{submitted}", prompt,
                                                     _random_params(rng, submitted)))
                submitted += 1
        if step % 17 == 5 and submitted:
            engine.abort_requests([f"r{rng.randrange(submitted)}"])
        for out in engine.step():
            if out.finished:
                finished.add((out.request_id, out.index))
        step += 1
    assert len(finished) > 500
    assert COUNTER.compiles == compiles_after_warm_up  # not one executable, on any thread
    assert worker.guard.num_recompiles == 0
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0
    buckets = set(worker.executed_buckets)
    assert {t for t, _ in buckets} == set(T_LADDER)  # every body was used
    assert len({r for _, r in buckets} - {0}) >= len(R_LADDER) - 1  # and most samplers
    assert len(worker.executed_variants) >= 2  # this mix mostly needs penalties and the search
    engine.shutdown()


def test_guard_raises_when_strict_and_counts_otherwise():
    triple = jax.jit(lambda x: x * 3)

    def compile_something(n):  # a new executable per new n (shape)
        return triple(np.arange(n, dtype=np.float32))

    strict, lenient = RecompileGuard(strict=True), RecompileGuard(strict=False)
    with strict.watch("before arming"):
        compile_something(3)  # warm-up compiles are fine
    assert strict.num_recompiles == 0
    strict.arm()
    lenient.arm()
    with pytest.raises(RecompileError, match="after warm-up"):
        with strict.watch("step 7"):
            compile_something(5)
    with lenient.watch("step 8"):
        compile_something(6)
    with lenient.watch("step 9"):
        compile_something(6)  # cached: no new executable
    assert (strict.num_recompiles, lenient.num_recompiles) == (1, 1)


def test_a_tally_counts_only_the_threads_that_count_into_it():
    """``compile_all``'s report counts its own threads: another thread's compile, at the
    same time, lands in the process-wide count only."""
    quadruple = jax.jit(lambda x: x * 4)
    tally, before = Tally(), COUNTER.compiles
    counted, other = threading.Event(), threading.Event()

    def counting():
        COUNTER.count_into(tally)
        try:
            quadruple(np.arange(7, dtype=np.float32))
        finally:
            counted.set()
            other.wait(60)  # the other thread compiles while this one still counts
            COUNTER.count_into(None)

    def not_counting():
        counted.wait(60)
        try:
            quadruple(np.arange(9, dtype=np.float32))
        finally:
            other.set()

    threads = [threading.Thread(target=counting), threading.Thread(target=not_counting)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert tally.compiles == 1
    assert COUNTER.compiles - before >= 2


def test_an_executable_a_step_waits_for_compiles_next():
    """A step waiting for a background executable waits for the compile in progress and
    its own, not for the whole queue before it."""
    tracing, release = threading.Event(), threading.Event()

    def blocker(x):  # traced on the background thread: holds it until released
        tracing.set()
        # Bounded: a failure below must not leave the thread, and the trace lock it
        # holds, blocked for the rest of the test process.
        release.wait(120)
        return x + 1

    spec = (jax.ShapeDtypeStruct((4,), np.float32),)
    executables = [StepExecutable("sampler", "blocker", blocker, spec)] + [
        StepExecutable("sampler", f"f{i}", lambda x, i=i: x * (i + 2), spec) for i in range(4)]
    functions = {}
    background = BackgroundCompile(executables, functions)
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(background.wait_for("f3")))
    try:
        assert tracing.wait(60)
        waiter.start()
        deadline = time.monotonic() + 60
        while background.queued()[0] != "f3" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert background.queued() == ["f3", "f0", "f1", "f2"]
    finally:
        release.set()
    if waiter.ident is not None:
        waiter.join()
    background.join()
    assert waited == [True]
    assert list(functions) == ["blocker", "f3", "f0", "f1", "f2"]  # the order they were ready
    assert background.queued() == [] and not background.prioritize("f3")


def test_precompile_off_compiles_on_first_use(tiny):
    config = EngineConfig(
        max_model_len=64, scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8,
                                                    token_buckets=(1, 4, 8)),
        cache=CacheConfig(block_size=4, num_kv_blocks=40),
        compile=CompileConfig(precompile=False, strict_recompile=True))
    worker = InProcessWorker(tiny, progress=False)
    engine = EngineCore(config, worker)
    assert worker.compile_report is None and not worker.guard.armed
    engine.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=3)))
    while engine.has_unfinished_requests():
        engine.step()  # lazy compiles are allowed: the guard is not armed
    assert worker.guard.num_recompiles == 0
