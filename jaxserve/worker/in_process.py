"""The in-process worker: model, KV cache, persistent device rows and the jitted step.

Implements ``jaxserve.step_plan.Worker``; the worker process
(``jaxserve.worker.server``) serves this same class over gRPC.

``initialize(init)`` loads the model, allocates the persistent rows on the
device (``device_state``), compiles the executables that do not take the KV
cache (the greedy and full samplers, the row writes), sizes the KV cache
(``kv_sizing``) and allocates it — with ``tensor_parallel_size`` > 1 on a
device mesh: the model and the KV cache split over it, everything else
replicated (``jaxserve.model.sharding``) — then compiles the bodies (``executables`` +
``compile_manager``; or loads them from the persistent compilation cache),
arms the recompile guard and starts the background compile of the other
sampler variants and of the prompt-logprob executables (docs/worker.md,
*Order of a start*).

In a multi-host worker (``jaxserve.worker.server --num-hosts``) the mesh spans
every host's devices; each process places only its own shards of host data
(``sharding.place``) and reads its own copy of replicated results, and all
processes agree on the KV cache size.

``submit(plan)`` dispatches a step and returns at once with a
``PendingStep`` (``jaxserve.worker.transfers``); ``execute(plan)`` is ``submit(plan).result()``. Dispatching:

1. the plan's row diffs update the host mirror (``rows.RowState``); a new
   row is written to the device rows by one staged write per step
   (``sync_rows``, padded to an R bucket) and, with penalties, by
   ``set_penalty_row``;
2. the schedule is validated and packed into one i32 buffer
   (``inputs.pack``), **the step's only upload**;
3. ``run_body`` (keyed on T) builds the step's inputs on the device, a
   decode row's input id being the row's last sampled token on the device,
   and, when rows sample, ``run_sampler`` (keyed on R and the sampler
   variant chosen from the rows' parameters) draws the tokens, writes them
   to the rows' ``last_token`` and starts their copy to the host
   (``copy_to_host_async``), **the step's only download**; with draft
   tokens (speculative decoding) the slots each row kept come back in the
   same download, and the next dispatch waits for them (the rows' lengths
   depend on how many drafts were accepted);
4. only in a step whose rows score prompt tokens (``prompt_logprobs`` set,
   the prompt not yet computed): ``run_prompt_logprobs`` (keyed on T) over
   the body's hidden states of every token, with its own upload (which
   tokens score which prompt token) and download.

Nothing in a dispatch waits for the device, so the caller dispatches step
N + 1 before it reads step N's tokens (``PendingStep.result``): the host's
work for step N + 1 overlaps step N on the device. Device work runs in
dispatch order, so a row freed and reused while an older step that used it
is in flight cannot be corrupted: the older step reads and writes the row
before the newer step's writes.

Buckets off the ladders are refused (ValueError). ``executed_buckets``
counts the (T, R) pairs run, ``executed_variants`` the sampler variants.
Dispatch is not thread-safe (one caller at a time, plans in step order);
``PendingStep.result`` may be called from another thread.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxserve.compressed_tensors import resolve_quantization
from jaxserve.config import check_kv_cache_fits, kv_cache_dtype_name
from jaxserve.model import quantization as quant, sharding
from jaxserve.model.attention import check_backend, default_backend
from jaxserve.model.kv_cache import (KVCache, init_kv_cache, is_fp8, kv_cache_bytes_per_block,
                                      kv_cache_shapes)
from jaxserve.model.loader import (is_scanned, kv_cache_scales, load_model, resolve_dtype,
                                   served_dtype)
from jaxserve.step_plan import Geometry, StepPlan, StepResult, WorkerInit, WorkerStatus
from jaxserve.worker import device_state as ds
from jaxserve.worker import model_runner as mr
from jaxserve.worker import transfers
from jaxserve.worker.compile_manager import (RecompileGuard, StepFunction, compile_all,
                                             BackgroundCompile,
                                             configure_persistent_cache, program_store)
from jaxserve.worker.executables import (LadderShapes, body_executable, body_name,
                                         draft_executables, draft_proposals_name,
                                         ladder_executables, lower_body,
                                         lower_sampler, prompt_logprobs_executable,
                                         prompt_logprobs_name, sampler_name, split_for_startup,
                                         variant_name)
from jaxserve.worker.inputs import StepLayout, pack, prompt_logprob_targets, query_input_ids
from jaxserve.worker.kv_sizing import device_memory, num_kv_blocks, peak_activation_bytes
from jaxserve.worker.rows import RowState
from jaxserve.worker.sampler import COMPILED_VARIANTS, FULL, SamplerVariant, masked_variant
from jaxserve.worker.sampler.bitmask import ALL_ALLOWED, num_words

logger = logging.getLogger(__name__)

# The largest body at a 2-block KV cache, compiled only to size the cache.
_SIZING_BODY = "kv sizing: largest body"


class InProcessWorker:
    """The worker in the caller's process.

    Args:
      loaded: an already loaded ``(config, graphdef, state)`` to use instead
        of loading ``WorkerInit.model`` (tests share one model this way).
      draft_loaded: the same for ``WorkerInit.draft_model``.
      progress: show the compile progress bar.
    """

    def __init__(self, loaded=None, *, draft_loaded=None, progress: bool = True):
        self._loaded = loaded
        self._draft_loaded = draft_loaded
        self.draft = None  # (config, graphdef, state) of the draft model, or None
        self._progress = progress
        self.executed_buckets: collections.Counter[tuple[int, int]] = collections.Counter()
        self.executed_variants: collections.Counter[str] = collections.Counter()
        self.execute_seconds = 0.0
        self.device_seconds = 0.0
        self.num_steps = 0
        self.compile_report = None
        self.functions: dict[str, StepFunction] = {}  # name → compiled at start-up
        self.guard = RecompileGuard()
        self.background_compile: BackgroundCompile | None = None  # middle sampler variants
        self._clock = transfers.DeviceClock()
        self._verifying: transfers.PendingStep | None = None  # the last step with drafts, until read
        self.num_proposal_steps = 0  # steps whose draft model proposed (draft_proposals[R])
        self.ready = False

    # ---------------------------------------------------------------- set-up
    def initialize(self, init: WorkerInit) -> Geometry:
        """Loads the model, sizes and allocates the KV cache and rows, compiles the ladders.

        Raises:
          ValueError: a KV cache of fewer than 2 blocks, a ladder above the
            limits (T above the token budget is fine; R above max_num_seqs not),
            or fp8 on a device without fp8 matrix units (``quantization.check_platform``),
            or a cache that cannot hold one sequence of max_model_len tokens
            (``jaxserve.config.check_kv_cache_fits``, before the bodies compile).
        """
        start = time.perf_counter()
        init = dataclasses.replace(  # quantization: a pre-quantized checkpoint's own method
            init, dtype=served_dtype(init.dtype, jax.default_backend()),
            quantization=resolve_quantization(init.model, init.quantization,
                                              init.tensor_parallel_size))
        if max(init.request_buckets) > init.max_num_seqs:
            raise ValueError(f"request_buckets {init.request_buckets} exceed max_num_seqs "
                             f"{init.max_num_seqs}")
        device = jax.devices()[0]
        quant.check_platform(init.quantization, device.platform,
                             getattr(device, "compute_capability", None))
        configure_persistent_cache(init.compilation_cache_dir)
        self.mesh = sharding.make_mesh(init.tensor_parallel_size)
        if jax.process_count() > 1 and (self.mesh is None or len(
                {d.process_index for d in self.mesh.devices.flat}) < jax.process_count()):
            raise ValueError(f"tensor_parallel_size={init.tensor_parallel_size} leaves hosts of "
                             f"this {jax.process_count()}-host worker without devices; use "
                             f"{jax.device_count()} (every host's devices)")
        self.placement = sharding.replicated(self.mesh)  # rows, tokens, the step's buffer
        if self._loaded is None:
            self._loaded = load_model(init.model, init.dtype, scan_layers=init.scan_layers,
                                      mesh=self.mesh, load_format=init.load_format,
                                      quantization=init.quantization)
        config, self.graphdef, self.state = self._loaded
        if is_scanned(self.state) != init.scan_layers:
            raise ValueError(f"scan_layers={init.scan_layers} but the given model was loaded "
                             f"with scan_layers={is_scanned(self.state)}")
        loaded_method = quant.params_method(self.state)
        if loaded_method != init.quantization:
            raise ValueError(f"quantization={init.quantization} but the given model was loaded "
                             f"with quantization={loaded_method}")
        loaded_tp = len(jax.tree.leaves(self.state)[0].sharding.device_set)
        if loaded_tp != init.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={init.tensor_parallel_size} but the given "
                             f"model was loaded onto {loaded_tp} device(s)")
        dtype = resolve_dtype(init.dtype)
        cache_dtype = jnp.dtype(kv_cache_dtype_name(init.kv_cache_dtype, init.dtype))
        self.model_config, self.init = config, init
        self.draft = self._load_draft(init, config)
        scales = self._kv_scales(init.model, config, cache_dtype)  # checked before any compile
        draft_scales = (None if self.draft is None else
                        self._kv_scales(init.draft_model, self.draft[0], cache_dtype))
        max_len = config.max_position_embeddings
        max_model_len = min(init.max_model_len or max_len, max_len)
        m = init.max_num_seqs
        self.rows = RowState(m, max_model_len, init.block_size, config.vocab_size,
                             config.eos_token_ids)
        self.backend = init.attention_backend or default_backend(config.head_dim)
        check_backend(self.backend)  # the cpu kernel is built and registered before any compile
        # The persistent rows first: automatic KV sizing counts them as in use.
        self.device_rows = sharding.place(ds.host_rows(self.rows), self.placement)
        self.last_token = sharding.place(np.zeros(m + 1, np.int32), self.placement)
        self.penalty = sharding.place(ds.PenaltyState(
            np.zeros((m + 1, config.vocab_size), bool),
            np.zeros((m + 1, config.vocab_size), np.int32)), self.placement)
        hidden = jax.ShapeDtypeStruct((m, config.hidden_size), dtype, sharding=self.placement)
        shapes = lambda kv: LadderShapes(self.graphdef, self.state, kv, self.rows,  # noqa: E731
                                         hidden, self.backend, self.placement)
        devices = (jax.devices()[:1] if self.mesh is None else  # this process's: multi-host
                   [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()])
        memory = device_memory(devices)
        sizing_kv = self._kv_spec(2, cache_dtype)
        store = program_store(init.compilation_cache_dir) if init.precompile else None
        first = None
        if init.precompile:
            # Before the KV cache is sized: the executables that do not take it
            # (samplers, row writes) and, for automatic sizing, the largest body at
            # a 2-block cache — compiled together, in parallel; the sizing reads
            # the largest sampler from the ladder's own executable.
            now, later = split_for_startup(ladder_executables(
                shapes(sizing_kv), init.token_buckets, init.request_buckets))
            if jax.process_count() > 1:  # every host must run the same variant in a step
                now, later = now + later, []
            automatic = (init.num_kv_blocks is None and init.kv_cache_bytes is None
                         and memory is not None)
            sizing = [dataclasses.replace(
                body_executable(shapes(sizing_kv), max(init.token_buckets)), kind="sizing",
                name=_SIZING_BODY)] if automatic else []
            if automatic:  # the largest prompt-logprob step's temporaries are sized for too
                top = prompt_logprobs_name(max(init.token_buckets))
                sizing += [e for e in later if e.name == top]
                later = [e for e in later if e.name != top]
            first = compile_all([e for e in now if e.kind != "body"] + sizing,
                                progress=self._progress, store=store,
                                desc="compiling samplers and row writes")
        bytes_per_block = sum(kv_cache_bytes_per_block(c, init.block_size, cache_dtype)
                              for c in [config] + ([self.draft[0]] if self.draft else []))
        num_blocks = num_kv_blocks(
            num_blocks=init.num_kv_blocks, kv_cache_bytes=init.kv_cache_bytes,
            bytes_per_block=bytes_per_block // init.tensor_parallel_size,  # one device's share
            memory=memory, utilization=init.memory_utilization,
            platform=devices[0].platform,
            activation_bytes=lambda: self._activation_bytes(shapes(sizing_kv), first))
        if jax.process_count() > 1:  # every host of a multi-host mesh allocates the same cache
            num_blocks = int(multihost_utils.process_allgather(np.int64(num_blocks)).min())
        if num_blocks < 2:
            raise ValueError(f"the KV cache must have >= 2 blocks, got {num_blocks}")
        check_kv_cache_fits(num_blocks, init.block_size, max_model_len)  # before the bodies compile
        self.kv_cache = init_kv_cache(config, num_blocks, init.block_size, cache_dtype,
                                      stacked=init.scan_layers, mesh=self.mesh, scales=scales)
        self.draft_kv_cache = None if self.draft is None else init_kv_cache(
            self.draft[0], num_blocks, init.block_size, cache_dtype, stacked=init.scan_layers,
            mesh=self.mesh, scales=draft_scales)
        self.layouts = {t: StepLayout.for_bucket(t, m, init.block_size)
                        for t in init.token_buckets}
        self.request_buckets = tuple(sorted(init.request_buckets))
        self.guard = RecompileGuard(strict=init.strict_recompile)
        if init.precompile:
            bodies = [e for e in ladder_executables(shapes(self.kv_cache), init.token_buckets,
                                                    init.request_buckets) if e.kind == "body"]
            if self.draft is not None:
                bodies += draft_executables(self._draft_shapes(), init.token_buckets,
                                            init.request_buckets, init.num_speculative_tokens)
            second = compile_all(bodies, progress=self._progress,
                                 store=None if first.store_off_reason else store,
                                 desc="compiling model bodies")
            self.compile_report = first.combined(second)
            self.functions = {name: f for name, f in self.compile_report.functions.items()
                              if name != _SIZING_BODY}
            self.guard.arm()
            # The middle sampler variants: until one is ready, its steps run the
            # cheapest ready variant that covers it (``_ready_variant``).
            self.background_compile = BackgroundCompile(
                later, self.functions,
                None if self.compile_report.store_off_reason else store)
        self.geometry = Geometry(num_kv_blocks=int(num_blocks), block_size=init.block_size,
                                 max_model_len=max_model_len, vocab_size=config.vocab_size,
                                 eos_token_ids=tuple(config.eos_token_ids))
        self.ready = True
        logger.info("worker ready in %.1f s: %d KV blocks x %d tokens (%s, KV cache %s), "
                    "backend %s", time.perf_counter() - start, num_blocks, init.block_size,
                    init.dtype, cache_dtype.name, self.backend)
        return self.geometry

    def _load_draft(self, init: WorkerInit, config):
        """The draft model ``(config, graphdef, state)``, or None without one.

        Raises:
          ValueError: a draft model without k >= 1, that does not load (a shape the
            mesh cannot split, a missing file; the message names the draft), whose
            vocabulary differs from the target's, or a pre-quantized fp8 one on a
            device without fp8 matrix units.
        """
        if init.draft_model is None and self._draft_loaded is None:
            return None
        if init.num_speculative_tokens < 1:
            raise ValueError(f"a draft model needs num_speculative_tokens >= 1, got "
                             f"{init.num_speculative_tokens}")
        try:
            draft = self._draft_loaded or load_model(
                init.draft_model, init.dtype, scan_layers=init.scan_layers, mesh=self.mesh,
                load_format=init.load_format)
        except (ValueError, FileNotFoundError) as err:  # name the draft, not the target
            raise ValueError(f"speculative_config model {init.draft_model}: {err}") from err
        device = jax.devices()[0]  # a pre-quantized (fp8) draft checkpoint loads as fp8
        quant.check_platform(quant.params_method(draft[2]), device.platform,
                             getattr(device, "compute_capability", None))
        if draft[0].vocab_size != config.vocab_size:
            raise ValueError(f"speculative_config model {init.draft_model}: its vocabulary "
                             f"({draft[0].vocab_size} tokens) differs from the target "
                             f"model's ({config.vocab_size}); a draft model must share the "
                             f"tokenizer")
        return draft

    @staticmethod
    def _kv_scales(model_dir, config, cache_dtype):
        """An fp8 cache's calibrated scales from the checkpoint (``loader.kv_cache_scales``),
        or None: 1.0, and for other caches."""
        if not is_fp8(cache_dtype):
            return None
        scales = kv_cache_scales(model_dir, config.num_layers)
        if scales is not None:
            logger.info("fp8 KV cache scales from %s: k %s, v %s", model_dir,
                        np.round(scales[0], 4).tolist(), np.round(scales[1], 4).tolist())
        return scales

    def _draft_shapes(self) -> LadderShapes:
        config, graphdef, state = self.draft
        hidden = jax.ShapeDtypeStruct((self.rows.max_num_seqs, config.hidden_size),
                                      resolve_dtype(self.init.dtype), sharding=self.placement)
        return LadderShapes(graphdef, state, self.draft_kv_cache, self.rows, hidden,
                            self.backend, self.placement)

    def _kv_spec(self, num_blocks: int, dtype) -> KVCache:
        return kv_cache_shapes(self.model_config, num_blocks, self.init.block_size, dtype,
                               stacked=self.init.scan_layers, mesh=self.mesh)

    def _activation_bytes(self, shapes: LadderShapes, compiled) -> int:
        """Peak temporaries of the largest-T body, its prompt logprobs, and the largest-R
        FULL sampler (a step with prompt-logprob rows holds all three at once).

        ``compiled``: the start-up's first ``CompileReport`` (it holds them);
        None (``precompile`` off): compiled here.
        """
        init = self.init
        t = max(init.token_buckets)
        if compiled is None:
            return peak_activation_bytes([
                lower_body(shapes, t).compile(),
                prompt_logprobs_executable(shapes, t).lower().compile(),
                lower_sampler(shapes, max(init.request_buckets)).compile()])
        sampler = sampler_name(max(init.request_buckets), FULL)
        return peak_activation_bytes([compiled.functions[_SIZING_BODY].compiled,
                                      compiled.functions[prompt_logprobs_name(t)].compiled,
                                      compiled.functions[sampler].compiled])

    def shutdown(self) -> None:
        self.ready = False
        if self.background_compile is not None:
            self.background_compile.stop()
        self.kv_cache = self.device_rows = self.last_token = self.penalty = None
        self.draft_kv_cache = None

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
        """Runs one step plan and waits for its tokens; see the module docstring."""
        return self.submit(plan).result()

    def submit(self, plan: StepPlan) -> transfers.PendingStep:
        """Dispatches one step plan without waiting for the device.

        Raises:
          ValueError: a bucket off the ladders, or a plan inconsistent with
            the rows (see ``RowState`` and ``inputs.query_input_ids``).
          RecompileError: the step compiled after warm-up (strict mode).
        """
        start = time.perf_counter()
        t, r = plan.num_tokens_bucket, plan.num_reqs_bucket
        if t not in self.layouts or (r and r not in self.request_buckets):
            raise ValueError(f"bucket (T={t}, R={r}) is not on the ladders")
        with self.guard.watch(f"step {plan.step_id} (T={t}, R={r})"):
            pending = self._dispatch(plan, self.layouts[t], r, start)
        self.executed_buckets[(t, r)] += 1
        self.num_steps += 1
        return pending

    def _count(self, result: StepResult) -> None:
        self.execute_seconds += result.execute_seconds
        self.device_seconds += result.device_seconds

    def _dispatch(self, plan: StepPlan, layout: StepLayout, r: int, start: float) -> transfers.PendingStep:
        rows = self.rows
        if self._verifying is not None:  # its rows' lengths are known once it returns
            self._verifying.result()
            self._verifying = None
        rows.free(plan.freed_rows)
        synced = {new.row for new in plan.new_rows}
        for new in plan.new_rows:
            meta = rows.add(new)
            if rows.has_penalty[new.row]:
                self.penalty = self._call("set_penalty_row", ds.set_penalty_row, self.penalty,
                                          *transfers.upload((np.int32(new.row), meta.prompt_mask[0],
                                                   meta.output_counts[0]), self.placement))
        append_rows, append_blocks = plan.append_rows, plan.append_block_ids
        append_index = rows.append_blocks(append_rows, append_blocks)
        if len(append_rows) > layout.num_appends:  # rare: resend those rows' whole tables
            synced.update(append_rows.tolist())
            append_rows = append_index = append_blocks = np.zeros(0, np.int32)
        input_ids = query_input_ids(rows, plan)
        if synced:
            self._sync_rows(np.array(sorted(synced), np.int32))
        slots = plan.slots_per_row()  # [n] 0, or 1 + the row's drafts
        buffer = pack(
            layout, seed=self.init.seed, step_id=plan.step_id, input_ids=input_ids,
            rows=plan.rows, num_computed=plan.num_computed, num_tokens=plan.num_tokens,
            sample=slots, append_rows=append_rows, append_index=append_index,
            append_blocks=append_blocks)
        masked = r and plan.token_bitmask is not None
        if masked:  # structured outputs: the bitmask travels in the step's one upload
            buffer, bitmask = transfers.upload((buffer, self._padded_bitmask(plan.token_bitmask, r)),
                                     self.placement)
        else:
            buffer, bitmask = transfers.upload(buffer, self.placement), None
        dispatched = time.perf_counter()
        self.kv_cache, block_table, hidden, sample_slots, hidden_all = self._call(
            f"body[T={layout.num_tokens}]", functools.partial(
                mr.run_body, self.graphdef, layout=layout, backend=self.backend),
            self.state, self.kv_cache, self.device_rows.block_table, self.last_token, buffer)
        if self.draft is not None:  # the draft model's keys and values of the same tokens
            self.draft_kv_cache, block_table, *_ = self._call(
                body_name(layout.num_tokens, draft=True), functools.partial(
                    mr.run_body, self.draft[1], layout=layout, backend=self.backend),
                self.draft[2], self.draft_kv_cache, block_table, self.last_token, buffer)
        self.device_rows = dataclasses.replace(self.device_rows, block_table=block_table)
        prompt = self._prompt_logprobs(plan, layout.num_tokens, hidden_all)
        if not r:
            return transfers.PendingStep(plan.step_id, 0, None, False, sample_slots.rows, dispatched,
                               dispatched - start, self._clock, self._count, prompt)
        sample_rows = np.repeat(plan.rows, slots)  # [s] each slot's row
        needed = rows.sampler_variant(sample_rows)
        variant = self._ready_variant(r, masked_variant(needed) if masked else needed)
        rows.count_sampled(plan.rows[plan.sample])
        penalty = self.penalty if variant.processing else ds.PenaltyState(None, None)
        out, kept, self.last_token, counts = self._call(
            sampler_name(r, variant), functools.partial(
                mr.run_sampler, self.graphdef, num_reqs=r, variant=variant),
            self.state, hidden, sample_slots, self.device_rows, self.last_token,
            penalty.prompt_mask, penalty.output_counts, bitmask)
        if variant.processing:
            self.penalty = ds.PenaltyState(self.penalty.prompt_mask, counts)
        self.executed_variants[variant_name(variant)] += 1
        logprobs = bool((rows.params["num_logprobs"][sample_rows] >= 0).any())
        per_row = slots[plan.sample]  # each sampling row's slots (1 + its drafts)
        first_slots = (np.cumsum(per_row) - per_row).astype(np.intp)
        drafts = None
        if plan.num_draft is not None:  # speculative decoding: the kept slots come back too
            sampling = plan.rows[plan.sample]
            drafts = (kept, first_slots, functools.partial(rows.count_accepted, sampling))
            kept.copy_to_host_async()
        proposals = None
        # The next step's drafts, in the same download — unless this step's sampling rows
        # fill the R ladder's top: each draft takes a sampling slot, so the next step
        # (as full) would have no room for them (the draft body above still runs: the
        # draft cache must hold every computed position).
        if self.draft is not None and plan.sample.sum() < self.request_buckets[-1]:
            k = self.init.num_speculative_tokens
            self.draft_kv_cache, proposed = self._call(
                draft_proposals_name(r), functools.partial(
                    mr.run_draft_proposals, self.draft[1], num_reqs=r, num_speculative_tokens=k,
                    backend=self.backend),
                self.draft[2], self.draft_kv_cache, self.device_rows.block_table,
                self.last_token, sample_slots, kept)
            proposed.copy_to_host_async()
            proposals = (proposed, first_slots)
            self.num_proposal_steps += 1
        for leaf in jax.tree.leaves(out if logprobs else out.token_ids):
            leaf.copy_to_host_async()
        pending = transfers.PendingStep(plan.step_id, len(sample_rows), out, logprobs, out.token_ids,
                              dispatched, dispatched - start, self._clock, self._count, prompt,
                              drafts, proposals)
        self._verifying = pending if drafts is not None else None
        return pending

    def _prompt_logprobs(self, plan: StepPlan, t: int, hidden: jax.Array):
        """Dispatches ``prompt_logprobs[T]`` when the step's rows score prompt tokens.

        Only such steps run it (and upload its i32[2, T] targets); it is
        compiled in the background at start-up, and a step that needs it
        before then waits for it (``_wait_for``), never compiling in the step.

        Returns:
          None, or (``model_runner.PromptLogprobs`` on the device, its copy to
          the host started; then the host's token, index and position arrays
          of ``inputs.prompt_logprob_targets``).
        """
        scored = prompt_logprob_targets(self.rows, plan, t)
        if scored is None:
            return None
        targets, token, index, position = scored
        name = prompt_logprobs_name(t)
        self._wait_for(name)
        out = self._call(name, functools.partial(mr.run_prompt_logprobs, self.graphdef),
                         self.state, hidden, transfers.upload(targets, self.placement))
        for leaf in jax.tree.leaves(out):
            leaf.copy_to_host_async()
        return out, token, index, position
    def _padded_bitmask(self, bitmask: np.ndarray, r: int) -> np.ndarray:
        """The plan's i32[s, W] bitmask padded to i32[R, W] with all-allowed rows."""
        s, words = bitmask.shape
        if words != num_words(self.rows.vocab_size):
            raise ValueError(f"token_bitmask has {words} words per row, the vocabulary of "
                             f"{self.rows.vocab_size} needs {num_words(self.rows.vocab_size)}")
        out = np.full((r, words), ALL_ALLOWED, np.int32)
        out[:s] = bitmask
        return out

    def _ready_variant(self, r: int, needed: SamplerVariant) -> SamplerVariant:
        """The cheapest compiled sampler variant at R = ``r`` that covers ``needed``.

        ``needed`` itself once compiled; before that (a variant compiled in the
        background) a wider one, FULL at worst, whose tokens are the same.
        A masked variant (a step with structured-output rows) is covered only by
        the masked variants: until one that covers it is compiled (in the
        background) the step waits for ``needed``, never compiling in the
        step. With ``precompile`` off, ``needed`` (compiled on first use).

        Raises:
          RuntimeError: ``needed`` must be waited for and its background compile failed.
        """
        if not self.init.precompile:
            return needed
        ready = [v for v in COMPILED_VARIANTS
                 if v.covers(needed) and sampler_name(r, v) in self.functions]
        if ready:
            return ready[0]
        self._wait_for(sampler_name(r, needed))
        return needed

    def _wait_for(self, name: str) -> None:
        """Waits for the background compile of ladder executable ``name`` (if not ready).

        Raises:
          RuntimeError: its background compile failed.
        """
        if not self.init.precompile or name in self.functions:
            return
        logger.info("step waits for the background compile of %s", name)
        if self.background_compile is None or not self.background_compile.wait_for(name):
            raise RuntimeError(f"{name} is not compiled (its background compile failed)")

    def _sync_rows(self, rows: np.ndarray) -> None:
        """One staged write of whole rows (host mirror → device), padded to an R bucket."""
        m = self.rows.max_num_seqs
        for i in range(0, len(rows), self.request_buckets[-1]):
            part = rows[i:i + self.request_buckets[-1]]
            r = next(b for b in self.request_buckets if b >= len(part))
            index = np.full(r, m + 1, np.int32)  # M + 1: dropped
            index[:len(part)] = part
            values = ds.host_rows(self.rows, np.minimum(index, m))
            self.device_rows = self._call(f"sync_rows[R={r}]", ds.sync_rows, self.device_rows,
                                          *transfers.upload((index, values), self.placement))

    def _call(self, name: str, jitted, *args):
        """Runs ladder executable ``name``: the ``StepFunction`` compiled at start-up, or —
        with ``WorkerInit.precompile`` off — the jitted function, compiled on first use."""
        function = self.functions.get(name)
        return function(*args) if function is not None else jitted(*args)
