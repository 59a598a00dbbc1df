"""The engine core: scheduler + worker, one step at a time (jax-free).

``EngineCore(config, worker)`` initializes the worker (which reports the
geometry: KV blocks, block size, max model length, vocabulary, EOS ids),
then each ``step()`` does::

    schedule() → build_plan() → worker.execute(plan) → update() → outputs

The worker is anything with the ``jaxserve.step_plan.Worker`` interface:
``jaxserve.worker.InProcessWorker`` in the same process, a gRPC stub later;
the engine's code does not change between them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from jaxserve.engine.config import EngineConfig
from jaxserve.engine.messages import EngineCoreOutput, EngineCoreRequest, EngineStats
from jaxserve.engine.plan_builder import build_plan
from jaxserve.engine.scheduler import Scheduler
from jaxserve.step_plan import Geometry, Worker

logger = logging.getLogger(__name__)


class EngineCore:
    """The in-process engine core (vLLM's ``EngineCore``).

    Args:
      config: the engine configuration (unresolved: the worker fills in the
        geometry).
      worker: a ``Worker``; ``initialize`` is called here.

    Attributes:
      config: the resolved configuration.
      geometry: what the worker reported.
      schedule_seconds: CPU seconds spent in schedule + plan + update, in total.
    """

    def __init__(self, config: EngineConfig, worker: Worker):
        self.worker = worker
        self.geometry: Geometry = worker.initialize(config.worker_init())
        self.config = config.resolved(self.geometry)
        self.scheduler = Scheduler(self.config)
        self.num_steps = 0
        self.schedule_seconds = 0.0
        logger.info("engine ready: %d KV blocks of %d tokens, max_model_len %d, T ladder %s, "
                    "R ladder %s", self.geometry.num_kv_blocks, self.geometry.block_size,
                    self.geometry.max_model_len, self.config.scheduler.token_buckets,
                    self.config.scheduler.request_buckets)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a request. Raises ValueError on an invalid one (see ``Scheduler.add_request``)."""
        self.scheduler.add_request(request, self.geometry.vocab_size)

    def abort_requests(self, ids: Iterable[str | tuple[str, int]]) -> None:
        """Aborts whole requests (ids) or single sequences ((id, index)); frees their blocks."""
        self.scheduler.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedules and runs one step; returns the sequences' new tokens.

        Returns [] when there is nothing to run.
        """
        t0 = time.process_time()
        scheduled = self.scheduler.schedule()
        if not scheduled.reqs:
            self.scheduler.freed_rows[:0] = scheduled.freed_rows  # keep them for the next plan
            return []
        sched = self.config.scheduler
        plan = build_plan(scheduled, self.num_steps, sched.token_buckets, sched.request_buckets)
        t1 = time.process_time()
        result = self.worker.execute(plan)
        t2 = time.process_time()
        outputs = self.scheduler.update(scheduled, result)
        self.schedule_seconds += (t1 - t0) + (time.process_time() - t2)
        self.num_steps += 1
        return outputs

    def stats(self) -> EngineStats:
        """A snapshot of queue lengths, KV blocks and prefix-cache counters."""
        s, bm = self.scheduler, self.scheduler.block_manager
        cached = bm.num_cached_free_blocks()
        return EngineStats(
            num_waiting=len(s.waiting), num_running=len(s.running),
            kv_blocks_total=bm.num_total_blocks, kv_blocks_free=bm.num_free_blocks - cached,
            kv_blocks_cached=cached, kv_blocks_used=bm.num_total_blocks - bm.num_free_blocks,
            prefix_cache_queries=bm.query_tokens, prefix_cache_hits=bm.hit_tokens,
            num_preemptions=s.num_preemptions, num_steps=self.num_steps)

    def shutdown(self) -> None:
        self.worker.shutdown()
