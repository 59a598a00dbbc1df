"""The in-process worker: model, KV cache, persistent rows and the jitted step.

Implements ``jaxserve.step_plan.Worker``. ``execute(plan)``:

1. applies the plan's row diffs to the host ``RowState`` (freed rows, new
   rows, appended blocks) and, for rows with penalties, to the device
   penalty statistics;
2. builds the fixed-shape inputs of the bucket (``inputs.py``) and runs
   ``run_body`` (keyed on T) and, if any row samples, ``run_sampler``
   (keyed on R);
3. appends the sampled tokens to the rows (they are the next decode
   inputs) and returns them with logprobs when asked.

Buckets off the ladders are refused (ValueError). ``executed_buckets``
counts the (T, R) pairs run, and ``num_compiled()`` the executables jit
holds, for tests and the later compile manager.
"""

from __future__ import annotations

import collections
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.attention import AttentionMetadata, default_backend
from jaxserve.model.kv_cache import init_kv_cache, kv_cache_bytes_per_block
from jaxserve.model.loader import load_model, resolve_dtype
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.step_plan import Geometry, StepPlan, StepResult, WorkerInit
from jaxserve.worker import model_runner as mr
from jaxserve.worker.inputs import prepare_body_inputs, prepare_sampling
from jaxserve.worker.rows import RowState

logger = logging.getLogger(__name__)


class InProcessWorker:
    """The worker in the engine's process.

    Args:
      loaded: an already loaded ``(config, graphdef, state)`` to use instead
        of loading ``WorkerInit.model`` (tests share one model this way).
    """

    def __init__(self, loaded=None):
        self._loaded = loaded
        self.executed_buckets: collections.Counter[tuple[int, int]] = collections.Counter()
        self.execute_seconds = 0.0

    # ---------------------------------------------------------------- set-up
    def initialize(self, init: WorkerInit) -> Geometry:
        """Loads the model, sizes and allocates the KV cache, creates the rows.

        Raises:
          ValueError: a KV cache of fewer than 2 blocks, or a ladder above the
            limits (T above the token budget is fine; R above max_num_seqs not).
        """
        start = time.perf_counter()
        if self._loaded is None:
            self._loaded = load_model(init.model, init.dtype)
        config, self.graphdef, self.state = self._loaded
        dtype = resolve_dtype(init.dtype)
        self.model_config, self.init = config, init
        max_len = config.max_position_embeddings
        max_model_len = min(init.max_model_len or max_len, max_len)
        num_blocks = init.num_kv_blocks
        if num_blocks is None:
            num_blocks = init.kv_cache_bytes // kv_cache_bytes_per_block(
                config, init.block_size, dtype)
        if num_blocks < 2:
            raise ValueError(f"the KV cache must have >= 2 blocks, got {num_blocks}")
        if max(init.request_buckets) > init.max_num_seqs:
            raise ValueError(f"request_buckets {init.request_buckets} exceed max_num_seqs "
                             f"{init.max_num_seqs}")
        self.kv_cache = init_kv_cache(config, num_blocks, init.block_size, dtype)
        self.rows = RowState(init.max_num_seqs, max_model_len, init.block_size,
                             config.vocab_size, config.eos_token_ids)
        self.backend = init.attention_backend or default_backend()
        self.token_buckets = frozenset(init.token_buckets)
        self.request_buckets = frozenset(init.request_buckets)
        self.prompt_mask = self.output_counts = None  # [M, V] on device, on first penalty row
        self._zeros: dict[int, tuple[jax.Array, jax.Array]] = {}
        self.geometry = Geometry(num_kv_blocks=int(num_blocks), block_size=init.block_size,
                                 max_model_len=max_model_len, vocab_size=config.vocab_size,
                                 eos_token_ids=tuple(config.eos_token_ids))
        logger.info("worker ready in %.1f s: %d KV blocks x %d tokens (%s), backend %s",
                    time.perf_counter() - start, num_blocks, init.block_size, init.dtype,
                    self.backend)
        return self.geometry

    def shutdown(self) -> None:
        self.kv_cache = self.prompt_mask = self.output_counts = None
        self._zeros.clear()

    def num_compiled(self) -> dict[str, int]:
        """Executables held by jit per function (all processes' jit caches share them)."""
        return {"run_body": mr.run_body._cache_size(), "run_sampler": mr.run_sampler._cache_size()}

    # --------------------------------------------------------------- a step
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step plan; see the module docstring.

        Raises:
          ValueError: a bucket off the ladders, or a plan inconsistent with
            the rows (see ``RowState`` and ``prepare_body_inputs``).
        """
        start = time.perf_counter()
        t, r = plan.num_tokens_bucket, plan.num_reqs_bucket
        if t not in self.token_buckets or (r and r not in self.request_buckets):
            raise ValueError(f"bucket (T={t}, R={r}) is not on the ladders")
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
        hidden, self.kv_cache = mr.run_body(
            self.graphdef, self.state, self.kv_cache, body.input_ids, body.positions, attention,
            body.logits_indices, backend=self.backend)
        self.executed_buckets[(t, r)] += 1
        if not r:
            self.execute_seconds += time.perf_counter() - start
            return StepResult(plan.step_id, np.zeros(0, np.int32))
        result = self._sample(plan, hidden, body.sample_rows, r)
        self.execute_seconds += time.perf_counter() - start
        return result

    def _sample(self, plan: StepPlan, hidden: jax.Array, sample_rows: np.ndarray,
                r: int) -> StepResult:
        rows, s = self.rows, len(sample_rows)
        padded = np.full(r, rows.max_num_seqs, np.int32)
        padded[:s] = sample_rows
        penalized = bool(rows.has_penalty[padded].any())
        if penalized:
            mask, counts = mr.gather_penalty_rows(self.prompt_mask, self.output_counts, padded)
        else:
            if r not in self._zeros:
                self._zeros[r] = mr.zeros_like_penalties(r, rows.vocab_size)
            mask, counts = self._zeros[r]
        metadata = prepare_sampling(rows, sample_rows, r, mask, counts, MAX_LOGPROBS)
        key = np.array([self.init.seed & 0xFFFFFFFF, plan.step_id & 0xFFFFFFFF], np.uint32)
        out = mr.run_sampler(self.graphdef, self.state, hidden, metadata, key)
        if penalized:
            self.output_counts = mr.add_output_counts(self.output_counts, padded, out.token_ids)
        token_ids = np.asarray(out.token_ids)[:s]
        rows.append_sampled(sample_rows, token_ids)
        if not (metadata.num_logprobs[:s] >= 0).any():
            return StepResult(plan.step_id, token_ids)
        logprob, rank, top_lp, top_ids = jax.device_get(
            (out.logprob, out.rank, out.top_logprobs, out.top_token_ids))
        return StepResult(plan.step_id, token_ids, logprob[:s], rank[:s], top_ids[:s], top_lp[:s])

    def _set_penalty_row(self, row: int, mask_row: np.ndarray, counts_row: np.ndarray) -> None:
        if self.prompt_mask is None:
            m, v = self.rows.max_num_seqs, self.rows.vocab_size
            self.prompt_mask = jnp.zeros((m, v), bool)
            self.output_counts = jnp.zeros((m, v), jnp.int32)
        self.prompt_mask, self.output_counts = mr.set_penalty_row(
            self.prompt_mask, self.output_counts, np.int32(row), mask_row, counts_row)
