"""The in-process worker: model, KV cache, persistent rows and the jitted step.

Implements ``jaxserve.step_plan.Worker``; the worker process
(``jaxserve.worker.server``) serves this same class over gRPC.

``initialize(init)`` loads the model, sizes the KV cache (``kv_sizing``),
allocates it and the rows, then compiles every executable of the ladders
(``executables`` + ``compile_manager``; or loads them from the persistent
compilation cache) and arms the recompile guard.

``execute(plan)``:

1. applies the plan's row diffs to the host ``RowState`` (freed rows, new
   rows, appended blocks) and, for rows with penalties, to the device
   penalty statistics;
2. builds the fixed-shape inputs of the bucket (``inputs.py``) and runs
   ``run_body`` (keyed on T) and, if any row samples, ``run_sampler``
   (keyed on R);
3. appends the sampled tokens to the rows (they are the next decode
   inputs) and returns them with logprobs when asked, and the step's
   worker and device times.

Buckets off the ladders are refused (ValueError). ``executed_buckets``
counts the (T, R) pairs run, and ``num_compiled()`` the executables jit
holds. Not thread-safe: one caller at a time, plans in step order.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time

import jax
import numpy as np

from jaxserve.model.attention import AttentionMetadata, default_backend
from jaxserve.model.kv_cache import (KVCache, init_kv_cache, kv_cache_bytes_per_block,
                                      kv_cache_shapes)
from jaxserve.model.loader import is_scanned, load_model, resolve_dtype
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.step_plan import Geometry, StepPlan, StepResult, WorkerInit, WorkerStatus
from jaxserve.worker import model_runner as mr
from jaxserve.worker.compile_manager import (RecompileGuard, StepFunction, compile_all,
                                             configure_persistent_cache, program_store)
from jaxserve.worker.executables import LadderShapes, ladder_executables, lower_body, lower_sampler
from jaxserve.worker.inputs import prepare_body_inputs, prepare_sampling
from jaxserve.worker.kv_sizing import device_memory, num_kv_blocks, peak_activation_bytes
from jaxserve.worker.rows import RowState

logger = logging.getLogger(__name__)


class InProcessWorker:
    """The worker in the caller's process.

    Args:
      loaded: an already loaded ``(config, graphdef, state)`` to use instead
        of loading ``WorkerInit.model`` (tests share one model this way).
      progress: show the compile progress bar.
    """

    def __init__(self, loaded=None, *, progress: bool = True):
        self._loaded = loaded
        self._progress = progress
        self.executed_buckets: collections.Counter[tuple[int, int]] = collections.Counter()
        self.execute_seconds = 0.0
        self.device_seconds = 0.0
        self.num_steps = 0
        self.compile_report = None
        self.functions: dict[str, StepFunction] = {}  # name → compiled at start-up
        self.guard = RecompileGuard()
        self.ready = False

    # ---------------------------------------------------------------- set-up
    def initialize(self, init: WorkerInit) -> Geometry:
        """Loads the model, sizes and allocates the KV cache, compiles the ladders.

        Raises:
          ValueError: a KV cache of fewer than 2 blocks, or a ladder above the
            limits (T above the token budget is fine; R above max_num_seqs not).
        """
        start = time.perf_counter()
        if max(init.request_buckets) > init.max_num_seqs:
            raise ValueError(f"request_buckets {init.request_buckets} exceed max_num_seqs "
                             f"{init.max_num_seqs}")
        configure_persistent_cache(init.compilation_cache_dir)
        if self._loaded is None:
            self._loaded = load_model(init.model, init.dtype, scan_layers=init.scan_layers)
        config, self.graphdef, self.state = self._loaded
        if is_scanned(self.state) != init.scan_layers:
            raise ValueError(f"scan_layers={init.scan_layers} but the given model was loaded "
                             f"with scan_layers={is_scanned(self.state)}")
        dtype = resolve_dtype(init.dtype)
        self.model_config, self.init = config, init
        max_len = config.max_position_embeddings
        max_model_len = min(init.max_model_len or max_len, max_len)
        self.rows = RowState(init.max_num_seqs, max_model_len, init.block_size,
                             config.vocab_size, config.eos_token_ids)
        self.backend = init.attention_backend or default_backend()
        hidden = jax.ShapeDtypeStruct((init.max_num_seqs, config.hidden_size), dtype)
        shapes = lambda kv: LadderShapes(self.graphdef, self.state, kv, self.rows,  # noqa: E731
                                         hidden, self.backend)
        num_blocks = num_kv_blocks(
            num_blocks=init.num_kv_blocks, kv_cache_bytes=init.kv_cache_bytes,
            bytes_per_block=kv_cache_bytes_per_block(config, init.block_size, dtype),
            memory=device_memory(jax.devices()[0]), utilization=init.memory_utilization,
            activation_bytes=lambda: self._activation_bytes(shapes(self._kv_spec(2, dtype))))
        if num_blocks < 2:
            raise ValueError(f"the KV cache must have >= 2 blocks, got {num_blocks}")
        self.kv_cache = init_kv_cache(config, num_blocks, init.block_size, dtype,
                                      stacked=init.scan_layers)
        self.token_buckets = frozenset(init.token_buckets)
        self.request_buckets = frozenset(init.request_buckets)
        self.prompt_mask = self.output_counts = None  # [M, V] on device, on first penalty row
        self._zeros: dict[int, tuple[jax.Array, jax.Array]] = {}
        self.guard = RecompileGuard(strict=init.strict_recompile)
        if init.precompile:
            self.compile_report = compile_all(
                ladder_executables(shapes(self.kv_cache), init.token_buckets,
                                   init.request_buckets), progress=self._progress,
                store=program_store(init.compilation_cache_dir))
            self.functions = self.compile_report.functions
            self.guard.arm()
        self.geometry = Geometry(num_kv_blocks=int(num_blocks), block_size=init.block_size,
                                 max_model_len=max_model_len, vocab_size=config.vocab_size,
                                 eos_token_ids=tuple(config.eos_token_ids))
        self.ready = True
        logger.info("worker ready in %.1f s: %d KV blocks x %d tokens (%s), backend %s",
                    time.perf_counter() - start, num_blocks, init.block_size, init.dtype,
                    self.backend)
        return self.geometry

    def _kv_spec(self, num_blocks: int, dtype) -> KVCache:
        return kv_cache_shapes(self.model_config, num_blocks, self.init.block_size, dtype,
                               stacked=self.init.scan_layers)

    def _activation_bytes(self, shapes: LadderShapes) -> int:
        """Peak temporaries of the largest-T body and largest-R sampler (compiled for it)."""
        init = self.init
        return peak_activation_bytes([lower_body(shapes, max(init.token_buckets)).compile(),
                                      lower_sampler(shapes, max(init.request_buckets)).compile()])

    def shutdown(self) -> None:
        self.ready = False
        self.kv_cache = self.prompt_mask = self.output_counts = None
        self._zeros = {}

    def num_compiled(self) -> dict[str, int]:
        """Executables held by jit per function (all processes' jit caches share them)."""
        return {"run_body": mr.run_body._cache_size(), "run_sampler": mr.run_sampler._cache_size()}

    def status(self) -> WorkerStatus:
        report = self.compile_report
        return WorkerStatus(
            ready=self.ready, platform=jax.default_backend() if self.ready else "",
            num_executables=report.num_executables if report else 0,
            compile_seconds=report.seconds if report else 0.0,
            num_cache_hits=report.num_cache_hits if report else 0,
            num_recompiles=self.guard.num_recompiles, num_steps=self.num_steps)

    def start_profile(self, directory: str) -> None:
        """Starts a JAX profiler trace into ``directory`` (TensorBoard / Perfetto format)."""
        jax.profiler.start_trace(directory)

    def stop_profile(self) -> None:
        jax.profiler.stop_trace()

    # --------------------------------------------------------------- a step
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step plan; see the module docstring.

        Raises:
          ValueError: a bucket off the ladders, or a plan inconsistent with
            the rows (see ``RowState`` and ``prepare_body_inputs``).
          RecompileError: the step compiled after warm-up (strict mode).
        """
        start = time.perf_counter()
        t, r = plan.num_tokens_bucket, plan.num_reqs_bucket
        if t not in self.token_buckets or (r and r not in self.request_buckets):
            raise ValueError(f"bucket (T={t}, R={r}) is not on the ladders")
        with self.guard.watch(f"step {plan.step_id} (T={t}, R={r})"):
            result, device_seconds = self._run(plan, t, r)
        self.executed_buckets[(t, r)] += 1
        self.num_steps += 1
        elapsed = time.perf_counter() - start
        self.execute_seconds += elapsed
        self.device_seconds += device_seconds
        return dataclasses.replace(result, execute_seconds=elapsed, device_seconds=device_seconds)

    def _run(self, plan: StepPlan, t: int, r: int) -> tuple[StepResult, float]:
        rows = self.rows
        rows.free(plan.freed_rows)
        for new in plan.new_rows:
            meta = rows.add(new)
            if rows.has_penalty[new.row]:
                self._set_penalty_row(new.row, meta.prompt_mask[0], meta.output_counts[0])
        rows.append_blocks(plan.append_rows, plan.append_block_ids)
        body = prepare_body_inputs(rows, plan, rows.max_num_seqs)
        attention = AttentionMetadata(slot_mapping=body.slot_mapping, block_table=body.block_table,
                                      seq_lens=body.seq_lens, query_start_loc=body.query_start_loc)
        dispatched = time.perf_counter()
        hidden, self.kv_cache = self._call(
            f"body[T={t}]", functools.partial(mr.run_body, self.graphdef, backend=self.backend),
            self.state, self.kv_cache, body.input_ids, body.positions, attention,
            body.logits_indices)
        if not r:
            hidden.block_until_ready()
            return (StepResult(plan.step_id, np.zeros(0, np.int32)),
                    time.perf_counter() - dispatched)
        return self._sample(plan, hidden, body.sample_rows, r, dispatched)

    def _sample(self, plan: StepPlan, hidden: jax.Array, sample_rows: np.ndarray,
                r: int, dispatched: float) -> tuple[StepResult, float]:
        rows, s = self.rows, len(sample_rows)
        padded = np.full(r, rows.max_num_seqs, np.int32)
        padded[:s] = sample_rows
        penalized = bool(rows.has_penalty[padded].any())
        if penalized:
            mask, counts = self._call(f"gather_penalty_rows[R={r}]", mr.gather_penalty_rows,
                                      self.prompt_mask, self.output_counts, padded)
        else:
            if r not in self._zeros:
                self._zeros[r] = self._call(f"penalty_zeros[R={r}]", functools.partial(
                    mr.penalty_zeros, num_rows=r, vocab_size=rows.vocab_size))
            mask, counts = self._zeros[r]
        metadata = prepare_sampling(rows, sample_rows, r, mask, counts, MAX_LOGPROBS)
        key = np.array([self.init.seed & 0xFFFFFFFF, plan.step_id & 0xFFFFFFFF], np.uint32)
        out = self._call(f"sampler[R={r}]", functools.partial(mr.run_sampler, self.graphdef),
                         self.state, hidden, metadata, key)
        if penalized:
            self.output_counts = self._call(f"add_output_counts[R={r}]", mr.add_output_counts,
                                            self.output_counts, padded, out.token_ids)
        token_ids = np.asarray(out.token_ids)[:s]
        rows.append_sampled(sample_rows, token_ids)
        if not (metadata.num_logprobs[:s] >= 0).any():
            return StepResult(plan.step_id, token_ids), time.perf_counter() - dispatched
        logprob, rank, top_lp, top_ids = jax.device_get(
            (out.logprob, out.rank, out.top_logprobs, out.top_token_ids))
        device_seconds = time.perf_counter() - dispatched
        return (StepResult(plan.step_id, token_ids, logprob[:s], rank[:s], top_ids[:s],
                           top_lp[:s]), device_seconds)

    def _set_penalty_row(self, row: int, mask_row: np.ndarray, counts_row: np.ndarray) -> None:
        m = self.rows.max_num_seqs
        if self.prompt_mask is None:
            name = f"penalty_zeros[R={m}]" if m in self.request_buckets else f"penalty_zeros[M={m}]"
            self.prompt_mask, self.output_counts = self._call(name, functools.partial(
                mr.penalty_zeros, num_rows=m, vocab_size=self.rows.vocab_size))
        self.prompt_mask, self.output_counts = self._call(
            "set_penalty_row", mr.set_penalty_row, self.prompt_mask, self.output_counts,
            np.int32(row), mask_row, counts_row)

    def _call(self, name: str, jitted, *args):
        """Runs ladder executable ``name``: the ``StepFunction`` compiled at start-up, or —
        with ``WorkerInit.precompile`` off — the jitted function, compiled on first use."""
        function = self.functions.get(name)
        return function(*args) if function is not None else jitted(*args)
