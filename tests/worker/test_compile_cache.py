"""A restart with a warm persistent compilation cache loads every executable instead of compiling.

Two worker processes (``python -m jaxserve.worker.server``) in turn, on a
fresh cache directory, each initialized with the same tiny random-weight
Llama and ladders: the first compiles every executable (and fills the
cache), the second loads every one of them from it. "Ready" is the
``Initialize`` call: model load, KV cache, all executables. The process
start (interpreter, jax, transformers imports: about 3 s here) is the same
for both. Times are reported, not asserted (a timing assert is a flaky
test; docs/worker.md has the numbers): the counts are the check.
"""

from __future__ import annotations

import logging
import time

import pytest

from jaxserve.engine.grpc_worker import start_worker_process
from jaxserve.step_plan import WorkerInit
from tests.model.hf_tiny import make_tiny_model

logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_cache")
    make_tiny_model("LlamaForCausalLM", directory, seed=4)
    return str(directory)


def _start(model: str, cache_dir: str) -> tuple[float, float, object]:
    init = WorkerInit(model=model, dtype="float32", block_size=16, num_kv_blocks=64,
                      kv_cache_bytes=None, max_num_seqs=4, max_model_len=256,
                      token_buckets=(1, 4, 8, 16, 32, 64, 128), request_buckets=(1, 2, 4))
    t0 = time.perf_counter()
    worker = start_worker_process(compilation_cache_dir=cache_dir, log_level="WARNING")
    t1 = time.perf_counter()
    worker.initialize(init)
    t2 = time.perf_counter()
    status = worker.status()
    worker.shutdown()
    return t1 - t0, t2 - t1, status


def test_warm_cache_restart_loads_every_executable(tiny_dir, tmp_path):
    cache = str(tmp_path / "jax_cache")
    cold_start, cold_init, cold = _start(tiny_dir, cache)
    warm_start, warm_init, warm = _start(tiny_dir, cache)
    logger.warning("worker ready: first start %.1f s (process %.1f s + initialize %.1f s), "
                   "warm cache %.1f s (%.1f s + %.1f s)", cold_start + cold_init, cold_start,
                   cold_init, warm_start + warm_init, warm_start, warm_init)
    # Before ready: |T| bodies, |R| x 2 samplers (GREEDY, FULL; the other two
    # variants compile in the background), |R| staged row writes, set_penalty_row
    assert cold.num_cache_hits == 0 and cold.num_executables == 7 + 3 * 2 + 3 + 1
    assert warm.num_executables == cold.num_executables
    assert warm.num_cache_hits == warm.num_executables  # every executable loaded
