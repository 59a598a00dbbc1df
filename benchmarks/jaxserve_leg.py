"""The jaxserve leg of the offline benchmarks: a workload through ``jaxserve.LLM``.

Warm-up first: the same prompt lengths with different tokens and at most 2
output tokens, which runs every prefill bucket and the decode request
buckets the batch reaches, then waits for the worker's background compiles
(the middle sampler variants), so the timed run finds everything compiled
(compiles that still happen inside the timed window are counted and
reported). The
timed run is greedy with ``ignore_eos``: each request generates exactly its
output length.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from benchmarks.compile_watch import CacheCounter, CompileCounter
from benchmarks.dataset import Workload

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineOptions:
    """``jaxserve.LLM`` settings of a benchmark run (see ``LLM`` for their meaning)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    # None: sized as a server sizes it (free device memory on a GPU, 1 GiB on a CPU)
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    scan_layers: bool = False
    attention_backend: str | None = None  # None: the platform default
    quantization: str | None = None  # None: float weights; "int8": weight-only int8

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def add_arguments(parser) -> None:
    """The options of a benchmark that runs ``jaxserve.LLM`` in process: ``--attention-backend``."""
    parser.add_argument("--attention-backend", default=None,
                        help="jaxserve's attention backend: cpu, reference, pallas, pallas_interpret "
                             "(default: the platform's; docs/model.md)")


def make_llm(model: str | None, tokenizer: str | None, options: EngineOptions, *,
             profiled: bool = False):
    """A ``jaxserve.LLM``; ``profiled``: its worker marks each step in the trace.

    A profiled engine schedules synchronously, so that each step's mark spans
    that step's execution (with async scheduling the dispatch returns at once
    and the execution runs after the mark); an unprofiled one takes the
    default, async scheduling.
    """
    from jaxserve import LLM

    worker = None
    if profiled:
        from benchmarks import profiling

        worker = profiling.marking_worker()

    return LLM(model, tokenizer=tokenizer, max_num_seqs=options.max_num_seqs,
               max_num_batched_tokens=options.max_num_batched_tokens,
               block_size=options.block_size, kv_cache_bytes=options.kv_cache_bytes,
               max_model_len=options.max_model_len,
               enable_prefix_caching=options.enable_prefix_caching, dtype=options.dtype,
               scan_layers=options.scan_layers, attention_backend=options.attention_backend,
               quantization=options.quantization, async_scheduling=not profiled, worker=worker)


def warm_up(llm, workload: Workload, seed: int) -> float:
    """Runs the warm-up workload (see the module docstring); returns its seconds."""
    import numpy as np

    from jaxserve import SamplingParams

    rng = np.random.default_rng(seed + 1_000_003)
    high = llm.engine.geometry.vocab_size
    low = 100 if high > 200 else 0
    prompts = [rng.integers(low, high, len(p)).tolist() for p in workload.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    background = getattr(llm.engine.worker, "background_compile", None)
    if background is not None:
        background.join()
    return time.perf_counter() - start


def timed_generate(llm, workload: Workload) -> dict[str, Any]:
    """Generates the workload once and returns wall seconds, token counts and compiles."""
    from jaxserve import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    engine = llm.engine
    steps0 = getattr(engine, "num_steps", 0)
    compiles = CompileCounter()
    with compiles.watch():
        start = time.perf_counter()
        outputs = llm.generate([list(p) for p in workload.prompts], params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    if generated != workload.num_output_tokens:
        raise RuntimeError(f"jaxserve generated {generated} tokens, expected "
                           f"{workload.num_output_tokens}")
    steps = getattr(engine, "num_steps", steps0) - steps0
    return {"elapsed": elapsed, "output_tokens": generated,
            "output_tokens_per_s": generated / elapsed,
            "total_tokens_per_s": (generated + workload.num_prompt_tokens) / elapsed,
            "requests_per_s": len(workload) / elapsed, "steps": steps, **compiles.as_dict()}


def run_workloads(workloads: Mapping[str, Workload], *, model: str | None,
                  tokenizer: str | None, options: EngineOptions, seed: int) -> dict[str, Any]:
    """Loads the engine once and runs each workload on it: warm-up, then timed.

    Args:
      workloads: name -> workload, run in order on the same ``jaxserve.LLM``.
      seed: the warm-up prompts' seed (each workload's own seed is in its prompts).

    Returns:
      ``{"load_seconds": engine construction s, "load_cache": {"cache_hits",
      "cache_misses"}: executables the persistent compilation cache had, and
      compiled ones written to it (0 misses: a warm cache), "workloads": {name:
      the timed_generate dict plus warmup_seconds}}``.
    """
    cache = CacheCounter()
    with cache.watch():
        start = time.perf_counter()
        llm = make_llm(model, tokenizer, options)
        load = time.perf_counter() - start
    logger.info("jaxserve: engine ready in %.1f s (compilation cache: %d hits, %d misses)",
                load, cache.hits, cache.misses)
    results: dict[str, Any] = {}
    try:
        for i, (name, workload) in enumerate(workloads.items()):
            warm = warm_up(llm, workload, seed + i)
            logger.info("jaxserve: %s: warm-up %.1f s; timed run", name, warm)
            results[name] = {"warmup_seconds": warm, **timed_generate(llm, workload)}
    finally:
        llm.shutdown()
    return {"load_seconds": load, "load_cache": cache.as_dict(), "workloads": results}


def run(workload: Workload, *, model: str | None, tokenizer: str | None,
        options: EngineOptions, seed: int, profile_dir: str | None = None) -> dict[str, Any]:
    """Loads the engine, warms it up, runs the workload timed (profiled when asked).

    Returns the ``timed_generate`` dict plus ``load_seconds``, ``warmup_seconds``
    and, with ``profile_dir``, ``profile`` (``benchmarks.profiling`` breakdown).
    """
    start = time.perf_counter()
    llm = make_llm(model, tokenizer, options, profiled=profile_dir is not None)
    load = time.perf_counter() - start
    try:
        logger.info("jaxserve: engine ready in %.1f s; warming up", load)
        warm = warm_up(llm, workload, seed)
        logger.info("jaxserve: warm-up %.1f s; timed run", warm)
        if profile_dir is None:
            result = timed_generate(llm, workload)
        else:
            from benchmarks import profiling

            with profiling.profiled(profile_dir) as session:
                result = timed_generate(llm, workload)
            result["profile"] = session.report()
        return {"load_seconds": load, "warmup_seconds": warm, **result}
    finally:
        llm.shutdown()
