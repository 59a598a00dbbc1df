"""The engine core: scheduler + worker, one step per ``step()`` call (jax-free).

``EngineCore(config, worker)`` initializes the worker (which reports the
geometry: KV blocks, block size, max model length, vocabulary, EOS ids).
The worker is anything with the ``jaxserve.step_plan.Worker`` interface —
``jaxserve.worker.InProcessWorker`` in the same process,
``jaxserve.engine.grpc_worker.GrpcWorker`` in a worker process — and the
engine's code does not change between them.

**Synchronous** (``async_scheduling=False``), each ``step()`` does::

    schedule() → build_plan() → worker.execute(plan) → update() → outputs

**Asynchronous** (``async_scheduling=True``, docs/worker.md "Async
scheduling"): the engine plans and sends step N + 1 while step N runs —
through the worker's ``submit(plan)`` where it has one
(``InProcessWorker``: dispatches step N + 1 to the device and returns;
``GrpcWorker``: the worker process receives step N + 1 during step N and
dispatches it right after), else by calling ``execute`` on a helper thread
— so scheduling, plan building, the RPC hop and the caller's output
handling overlap the device instead of sitting between steps::

    step():  [submit step N if none is in flight]
             schedule + build + submit step N + 1   (step N still running)
             wait for step N → update() → return step N's outputs

Planning N + 1 before N's tokens are known works because decode input ids
come from the worker's own rows: the engine only needs to know that a
sequence sampling in step N will have one more token. For the duration of
that schedule such a sequence carries a **placeholder** token (vLLM's
output placeholders; never visible outside ``step()``), so it is scheduled
for the decode of the token in flight, and its blocks are registered in the
prefix cache only once the token is known (never hashed with a
placeholder). A sequence whose in-flight token will reach ``max_tokens``
gets no placeholder. Then, when step N's tokens come back:

- a sequence that stops at step N (EOS, stop id, max_tokens, aborted) was
  possibly scheduled in step N + 1 too: its token from step N + 1 is
  dropped (``Scheduler.update`` skips sequences no longer running), its row
  and blocks were released at step N's update and the row reaches the
  worker as a freed row of step N + 2, after step N + 1 has run;
- a sequence preempted while planning step N + 1 keeps the token it sampled
  in step N (it may also finish with it) and comes back later as a new row.

Structured outputs (``jaxserve.engine.grammar``): a request's grammar
compiles in a thread pool while its sequences wait in the waiting queue; a
step with a constrained sampling row carries the rows' token bitmask
(``StepPlan.token_bitmask``, computed from each sequence's matcher when the
step is planned), and the matcher consumes the token when the step's result
is applied. Such a row's next mask needs that token, so **a step with
constrained rows waits for the constrained rows in flight**: ``step()`` plans
step N + 1 while step N runs, as always, but when both carry constrained
rows it submits N + 1 only once N's result is applied and N + 1's masks are
computed from the advanced matchers::

    step():  schedule + build step N + 1 (no masks yet)   (step N still running)
             wait for step N → update() (matchers consume N's tokens)
             masks of N + 1 → submit step N + 1 → return step N's outputs

so scheduling and plan building still overlap step N, and the caller's
output handling overlaps step N + 1; only the update and the masks
(``compute_bitmask`` per constrained row) sit between the two steps.

Worker death: ``execute`` raises ``WorkerDiedError``; ``step()`` re-raises
it, and every later ``step()`` / ``add_request`` raises it at once
(``serving`` is then False).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Iterable

import numpy as np

from jaxserve.engine.config import EngineConfig
from jaxserve.engine.grammar import GrammarCompiler
from jaxserve.engine.messages import EngineCoreOutput, EngineCoreRequest, EngineStats
from jaxserve.engine.plan_builder import build_plan
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import ScheduledStep, Scheduler
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import Geometry, StepPlan, StepResult, Worker, WorkerDiedError
from jaxserve.validation import RequestLimits

logger = logging.getLogger(__name__)

PLACEHOLDER = -1  # a token in flight; never a real id (ids are >= 0)


@dataclasses.dataclass(slots=True)
class _InFlight:
    """A step submitted to the worker whose result has not been applied."""

    scheduled: ScheduledStep
    plan: StepPlan
    result: concurrent.futures.Future


class EngineCore:
    """The in-process engine core (vLLM's ``EngineCore``).

    Args:
      config: the engine configuration (unresolved: the worker fills in the
        geometry); ``config.async_scheduling`` picks the mode.
      worker: a ``Worker``; ``initialize`` is called here.

    Attributes:
      config: the resolved configuration (``EngineConfig.for_checkpoint``, then the
        worker's geometry).
      geometry: what the worker reported.
      limits: the ``RequestLimits`` every request is checked against (the
        geometry's vocabulary, length and EOS ids; ``max_num_seqs``).
      num_steps: steps whose results were applied.
      schedule_seconds: CPU seconds spent in schedule + plan + update, in total.
      worker_seconds / device_seconds: the worker's reported wall time per
        plan and, of that, device time, summed over applied steps.
      error: the ``WorkerDiedError`` that stopped the engine, or None.
    """

    def __init__(self, config: EngineConfig, worker: Worker):
        self.worker = worker
        config = config.for_checkpoint()  # a pre-quantized checkpoint's method
        self.geometry: Geometry = worker.initialize(config.worker_init())
        self.config = config.resolved(self.geometry)
        self.limits = RequestLimits(
            vocab_size=self.geometry.vocab_size, max_model_len=self.config.max_model_len,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            eos_token_ids=self.geometry.eos_token_ids)
        self.scheduler = Scheduler(self.config)
        self.grammars = GrammarCompiler(self.config.tokenizer or self.config.model,
                                        self.geometry.vocab_size, self.geometry.eos_token_ids)
        # A step's drafts are proposed from the tokens of the step before: no planning ahead.
        self.async_scheduling = config.async_scheduling and config.speculative_config is None
        self.num_steps = 0
        self.schedule_seconds = 0.0
        self.worker_seconds = 0.0
        self.device_seconds = 0.0
        self.error: WorkerDiedError | None = None
        self._next_step_id = 0
        self._in_flight: _InFlight | None = None
        self._failed: list[EngineCoreOutput] = []  # sequences whose grammar did not compile
        self._executor = (concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine-worker") if self.async_scheduling else None)
        logger.info("engine ready: %d usable KV blocks (+ the null block) of %d tokens, "
                    "max_model_len %d, T ladder %s, R ladder %s, %s scheduling",
                    self.geometry.num_kv_blocks - 1,
                    self.geometry.block_size, self.geometry.max_model_len,
                    self.config.scheduler.token_buckets, self.config.scheduler.request_buckets,
                    "async" if self.async_scheduling else "sync")
        spec = config.speculative_config
        if spec is not None:
            logger.info("speculative decoding: %s, up to %d draft tokens per sequence, %s",
                        spec.method, spec.num_speculative_tokens,
                        f"draft model {spec.model}" if spec.model else
                        f"prompt lookup {spec.prompt_lookup_min}..{spec.prompt_lookup_max}")
            sched = self.config.scheduler
            if 1 < sched.request_buckets[-1] <= spec.num_speculative_tokens:
                logger.warning(
                    "speculative decoding: num_speculative_tokens %d exceeds the room a "
                    "step has: each draft is a sampling slot and the R ladder's top is %d "
                    "(from max_num_seqs %d), so a sequence carries at most %d drafts%s; "
                    "raise max_num_seqs or lower num_speculative_tokens",
                    spec.num_speculative_tokens, sched.request_buckets[-1], sched.max_num_seqs,
                    self.config.max_drafts,
                    " (the draft model proposes that many)" if spec.model else "")
            if sched.request_buckets[-1] <= 1:
                logger.warning(
                    "speculative decoding has no room: each draft is a sampling slot, and "
                    "the R ladder's top (%d, from max_num_seqs %d) is taken by the running "
                    "sequences alone; raise max_num_seqs (drafts fit while fewer sequences "
                    "than the top run)", sched.request_buckets[-1], sched.max_num_seqs)

    # -------------------------------------------------------------- requests
    def add_request(self, request: EngineCoreRequest) -> None:
        """Checks a request against ``limits`` (``jaxserve.validation``), then queues it.

        Anything the worker would refuse is refused here, so a queued request
        never fails a step. ``max_tokens`` beyond the room the prompt leaves
        is capped there (the sequence finishes with "length").

        Raises:
          jaxserve.validation.InvalidArgument: a ``ValueError`` naming the
            field (``prompt_token_ids``, ``sampling_params.<name>``); also an
            unfinished request's id again, or a prompt beyond the step budget
            without chunked prefill (``Scheduler.add_request``).
          WorkerDiedError: the engine stopped serving.
        """
        self._check_serving()
        self.limits.check(request.prompt_token_ids, request.sampling_params,
                          prompt_field="prompt_token_ids")
        so = request.sampling_params.structured_outputs
        self.scheduler.add_request(request, None if so is None else self.grammars.submit(so))

    def check_structured_outputs(self, params: SamplingParams,
                                 timeout: float | None = None) -> None:
        """Compiles ``params.structured_outputs`` (if any) and waits in the caller's thread.

        Call it before ``add_request`` from a thread other than the one that
        steps (the api's handlers), or before stepping (``LLM``): a bad
        schema, regex or grammar is then refused up front.

        Raises:
          jaxserve.engine.grammar.GrammarError: (an ``InvalidArgument``) it
            does not compile; the field is named.
        """
        self.grammars.check(params.structured_outputs, timeout)

    def abort_requests(self, ids: Iterable[str | tuple[str, int]]) -> None:
        """Aborts whole requests (ids) or single sequences ((id, index)); frees their blocks."""
        self.scheduler.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def serving(self) -> bool:
        """False once the worker died."""
        return self.error is None

    def _check_serving(self) -> None:
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------ step
    def step(self) -> list[EngineCoreOutput]:
        """Runs one step (see the module docstring); returns sequences' new tokens.

        Returns [] when there is nothing to run.

        Raises:
          WorkerDiedError: the worker died (now, or before: the engine is dead).
          ValueError / RuntimeError: the worker refused or failed the step.
        """
        self._check_serving()
        try:
            return self._step_async() if self.async_scheduling else self._step_sync()
        except WorkerDiedError as err:
            self.error = err
            logger.error("the engine stops serving: %s", err)
            raise

    def _step_sync(self) -> list[EngineCoreOutput]:
        planned = self._with_masks(self._plan())
        if planned is None:
            return self._take_failed()
        scheduled, plan = planned
        return self._take_failed() + self._apply(scheduled, self.worker.execute(plan), ())

    def _take_failed(self) -> list[EngineCoreOutput]:
        """The outputs of sequences whose grammar failed, gathered while planning."""
        failed, self._failed = self._failed, []
        return failed

    def _step_async(self) -> list[EngineCoreOutput]:
        if self._in_flight is None:
            self._in_flight = self._submit(self._with_masks(self._plan()))
            if self._in_flight is None:
                return self._take_failed()
        current = self._in_flight
        placeholders = self._add_placeholders(current.scheduled)
        try:
            planned = self._plan()
        finally:
            for req, cacheable in placeholders:
                req.cacheable = cacheable
        # Constrained rows in flight and in the next step: its masks need their tokens.
        waits = (planned is not None and current.plan.token_bitmask is not None
                 and self._constrained(planned[0]))
        self._in_flight = None if waits else self._submit(self._with_masks(planned))
        outputs = self._apply(current.scheduled, current.result.result(),
                              [req for req, _ in placeholders])
        if waits:
            self._in_flight = self._submit(self._with_masks(planned))
        return self._take_failed() + outputs

    def _plan(self) -> tuple[ScheduledStep, StepPlan] | None:
        """Schedules and builds the next step, without its structured-output masks
        (``_with_masks`` adds them, after the step in flight is applied if it must)."""
        t0 = time.process_time()
        scheduled = self.scheduler.schedule()
        self._failed.extend(scheduled.failed)
        if not scheduled.reqs:
            self.scheduler.freed_rows[:0] = scheduled.freed_rows  # keep them for the next plan
            return None
        sched = self.config.scheduler
        plan = build_plan(scheduled, self._next_step_id, sched.token_buckets,
                          sched.request_buckets)
        self._next_step_id += 1
        self.schedule_seconds += time.process_time() - t0
        return scheduled, plan

    def _with_masks(self, planned: tuple[ScheduledStep, StepPlan] | None
                    ) -> tuple[ScheduledStep, StepPlan] | None:
        """``planned`` (``_plan``'s) with its masks computed now, from the matchers as
        they are; as it is when no sampling row is constrained."""
        if planned is None:
            return None
        t0 = time.process_time()
        scheduled, plan = planned
        mask = self._token_bitmask(scheduled)
        self.schedule_seconds += time.process_time() - t0
        return planned if mask is None else (
            scheduled, dataclasses.replace(plan, token_bitmask=mask))

    @staticmethod
    def _constrained(scheduled: ScheduledStep) -> bool:
        """Whether a sampling row of ``scheduled`` has structured outputs."""
        return any(sample and req.grammar is not None
                   for req, sample in zip(scheduled.reqs, scheduled.sample))

    def _token_bitmask(self, scheduled: ScheduledStep) -> np.ndarray | None:
        """i32[s, W]: the sampling slots' allowed tokens; None when none is constrained.

        A constrained sequence with drafts has one mask per slot: its grammar's
        next tokens, then after each draft in turn.
        """
        if not self._constrained(scheduled):
            return None
        words = -(-self.geometry.vocab_size // 32)
        num_slots = [scheduled.num_slots(i) for i in range(len(scheduled.reqs))]
        mask = np.full((sum(num_slots), words), -1, np.int32)  # -1: every token allowed
        j = 0
        for i, req in enumerate(scheduled.reqs):
            # A sequence the step in flight finished keeps all ones: its token is dropped,
            # and its matcher may have stopped on an error.
            if num_slots[i] and req.grammar is not None and not req.is_finished:
                drafts = scheduled.drafts[i] if scheduled.drafts else []
                mask[j:j + num_slots[i]] = (req.grammar.draft_bitmasks(drafts) if drafts
                                            else req.grammar.bitmask())
            j += num_slots[i]
        return mask

    def _submit(self, planned: tuple[ScheduledStep, StepPlan] | None) -> _InFlight | None:
        """Starts a step: ``worker.submit`` where the worker has it, else on the helper thread."""
        if planned is None:
            return None
        scheduled, plan = planned
        submit = getattr(self.worker, "submit", None)
        future = submit(plan) if submit is not None else self._executor.submit(
            self.worker.execute, plan)
        return _InFlight(scheduled, plan, future)

    def _add_placeholders(self, scheduled: ScheduledStep) -> list[tuple[Request, bool]]:
        """Appends a placeholder to each sequence whose token is in flight and that may go on.

        Returns (sequence, its ``cacheable``) pairs; ``cacheable`` is turned
        off until the schedule is done, so no block is hashed with a
        placeholder.
        """
        out = []
        for req, sample in zip(scheduled.reqs, scheduled.sample):
            if (sample and req.status == RequestStatus.RUNNING
                    and req.num_output_tokens + 1 < req.max_tokens):
                req.token_ids.append(PLACEHOLDER)
                out.append((req, req.cacheable))
                req.cacheable = False
        return out

    def _apply(self, scheduled: ScheduledStep, result: StepResult,
               placeholders: Iterable[Request]) -> list[EngineCoreOutput]:
        """Feeds a step's result to the scheduler (after removing the placeholders)."""
        t0 = time.process_time()
        for req in placeholders:
            assert req.token_ids[-1] == PLACEHOLDER, req
            req.token_ids.pop()
        # Sequences preempted after this step was planned still get its token.
        revived = [req for req, sample in zip(scheduled.reqs, scheduled.sample)
                   if sample and req.status == RequestStatus.WAITING]
        for req in revived:
            req.status = RequestStatus.RUNNING
        outputs = self.scheduler.update(scheduled, result)
        for req in revived:
            if req.status == RequestStatus.RUNNING:
                req.status = RequestStatus.WAITING
            else:  # finished by that token: it leaves the waiting queue
                self.scheduler.waiting.remove(req)
        bm = self.scheduler.block_manager
        for req in placeholders:
            if req.status == RequestStatus.RUNNING:
                bm.cache_full_blocks(req)  # blocks whose last token was in flight
        self.schedule_seconds += time.process_time() - t0
        self.worker_seconds += result.execute_seconds
        self.device_seconds += result.device_seconds
        self.num_steps += 1
        return outputs

    # ----------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        """A snapshot of queue lengths, KV blocks and prefix-cache counters."""
        s, bm = self.scheduler, self.scheduler.block_manager
        cached = bm.num_cached_free_blocks()
        return EngineStats(
            num_waiting=len(s.waiting), num_running=len(s.running),
            kv_blocks_total=bm.num_total_blocks, kv_blocks_free=bm.num_free_blocks - cached,
            kv_blocks_cached=cached, kv_blocks_used=bm.num_total_blocks - bm.num_free_blocks,
            prefix_cache_queries=bm.query_tokens, prefix_cache_hits=bm.hit_tokens,
            num_preemptions=s.num_preemptions, num_steps=self.num_steps,
            spec_decode_num_drafts=s.spec_num_drafts,
            spec_decode_num_draft_tokens=s.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens=s.spec_num_accepted_tokens,
            num_recompiles=self._worker_recompiles())

    def _worker_recompiles(self) -> int:
        """The worker's compiles after warm-up; the last known count when it cannot answer."""
        status = getattr(self.worker, "status", None)
        if status is not None and self.serving:
            try:
                self._num_recompiles = status().num_recompiles
            except Exception as err:  # noqa: BLE001 - stats must not fail the engine
                logger.debug("worker status unavailable: %s", err)
        return getattr(self, "_num_recompiles", 0)

    def shutdown(self) -> None:
        """Waits for a step in flight (its tokens are dropped), then shuts the worker down."""
        if self._in_flight is not None:
            try:
                self._in_flight.result.result()
            except Exception as err:  # noqa: BLE001 - shutting down anyway
                logger.warning("the step in flight failed during shutdown: %s", err)
            self._in_flight = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.grammars.shutdown()
        self.worker.shutdown()
