"""The engine → worker contract: step plans, step results, and the worker interface.

Jax-free (NumPy and the standard library only): the engine process imports
this module, and a later transport (gRPC) serializes these dataclasses field
by field — every array is a 1-D or 2-D NumPy array of a fixed dtype, every
other field a plain int / bool / str or a ``SamplingParams``.

The worker keeps one persistent **row** per running sequence for its
lifetime (docs/step_plan.md): its block table row, its token ids, its
sampling parameters and seed, its last sampled token, its penalty
statistics. A ``StepPlan`` carries only

- the **row diffs** since the previous plan, applied in this order:
  ``freed_rows`` (finished, aborted or preempted sequences), ``new_rows``
  (a sequence's first step on a row: all its known token ids, its
  parameters, its first blocks), ``append_rows`` / ``append_block_ids``
  (blocks appended to existing rows, in order);
- the **schedule**: the rows that run this step in token order, the tokens
  already in the cache for each (``num_computed``), how many query tokens
  each runs, and which rows sample a token afterwards;
- **draft tokens** (speculative decoding, docs/speculative_decoding.md): a
  sampling row may end its query with ``num_draft`` proposed tokens, which
  the step verifies: the row samples after each of its last
  ``1 + num_draft`` query tokens (its *slots*) and keeps the longest prefix
  of drafts its samples agree with, plus the sample after that prefix;
- the **bucket** ``(T, R)`` the worker pads the step to.

So a decode step's plan is O(rows), never O(rows × blocks). A row's input
tokens always come from the worker's own rows: prompt tokens from
``NewRow.token_ids``, generated tokens from what the worker itself sampled
(a decode row's input is its last sampled token, read on the device), so
the engine can plan step N + 1 before step N returns.
Preemption is a freed row; the sequence comes back later as a ``NewRow``
holding its prompt plus every token generated so far.

Shape legend (docs/legend.md): n scheduled rows, s = number of sampling
slots (``sample.sum()`` plus the drafts), F freed rows, A appended blocks, P a
row's known tokens, NL top logprobs per token, D the plan's draft tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from jaxserve.sampling_params import SamplingParams

_I32 = np.int32


def _i32(name: str, value: np.ndarray, ndim: int = 1) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype != _I32 or arr.ndim != ndim:
        raise ValueError(f"{name} must be i32 with {ndim} dims, got {arr.dtype} {arr.shape}")
    return arr


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInit:
    """What the engine asks the worker to load and how to size it (``initialize``).

    Attributes:
      model: a Hugging Face model directory, or None for the demo model.
      dtype: parameter and KV cache dtype name ("float32" on CPU).
      block_size: S, tokens per KV block.
      num_kv_blocks: B including the null block; None = size from
        ``kv_cache_bytes``.
      kv_cache_bytes: KV cache budget in bytes when ``num_kv_blocks`` is None;
        None = automatic: on a GPU / TPU the free device memory (times
        ``memory_utilization``) after the weights and the largest bucket's
        activations; on CPU ``DEFAULT_CPU_KV_CACHE_BYTES``.
      max_num_seqs: rows the worker keeps (the most running sequences).
      max_model_len: longest sequence in tokens; None = the model's maximum.
      token_buckets: the T ladder (ascending).
      request_buckets: the R ladder (ascending).
      attention_backend: None = the platform default.
      seed: seeds the server PRNG key of unseeded requests.
      memory_utilization: fraction of the device memory the worker may fill
        (weights + activations + KV cache) when sizing the cache automatically.
      precompile: compile (or load from the persistent compilation cache)
        every step executable of the ladders in ``initialize`` and arm the
        recompile guard; False compiles lazily on first use (development).
      strict_recompile: a compile after warm-up raises ``RecompileError``
        (tests); otherwise it is logged and counted (``WorkerStatus``).
      compilation_cache_dir: JAX's persistent compilation cache directory for
        the worker's process; None = leave JAX's setting (e.g. the
        ``JAX_COMPILATION_CACHE_DIR`` environment variable) alone.
      scan_layers: run the layers with ``jax.lax.scan`` over stacked weights
        (compiles ~4× faster; decodes ~1.3× slower on the CPU: docs/model.md).
      tensor_parallel_size: TP, the devices the worker splits the model and
        KV cache over (docs/scale_out.md); 1 = one device.
      load_format: "auto", "safetensors" or "orbax" (``jaxserve.model.loader``:
        convert the Hugging Face weights, or restore the directory's
        parameter checkpoint; auto = the checkpoint when there is one).
      quantization: None, "int8", "int4" or "fp8": weight-only int8 / group-wise int4,
        or e4m3 weights and activations (fp8, a GPU of compute capability >= 8.9 only),
        quantized at load time (``jaxserve.model.quantization``); a compressed-tensors
        fp8 checkpoint's own method replaces None (``compressed_tensors.resolve_quantization``).
      draft_model: a Hugging Face model directory whose model proposes draft
        tokens (speculative decoding, method "draft_model"), or None. It must
        share the target's vocabulary; it is loaded unquantized (a pre-quantized
        checkpoint as its own method), with the target's dtype, layer layout and
        tensor parallelism, and its KV cache has the target's blocks (the same
        block ids hold both models' keys and values of the same tokens).
      num_speculative_tokens: k, the draft model's tokens per row per step
        (with ``draft_model``).
      kv_cache_dtype: "auto" (the cache in ``dtype``), "fp8" or "fp8_e4m3" (e4m3
        keys and values with a scale per layer, the draft model's cache too;
        ``jaxserve.model.kv_cache``).
    """

    model: str | None
    dtype: str
    block_size: int
    num_kv_blocks: int | None
    kv_cache_bytes: int | None
    max_num_seqs: int
    max_model_len: int | None
    token_buckets: tuple[int, ...]
    request_buckets: tuple[int, ...]
    attention_backend: str | None = None
    seed: int = 0
    memory_utilization: float = 0.9
    precompile: bool = True
    strict_recompile: bool = False
    compilation_cache_dir: str | None = None
    scan_layers: bool = False
    tensor_parallel_size: int = 1
    load_format: str = "auto"
    quantization: str | None = None
    draft_model: str | None = None
    num_speculative_tokens: int = 0
    kv_cache_dtype: str = "auto"


@dataclasses.dataclass(frozen=True, slots=True)
class Geometry:
    """What the worker reports after ``initialize``.

    Attributes:
      num_kv_blocks: B, including the null block 0 (never allocated).
      block_size: S.
      max_model_len: longest sequence in tokens (prompt + output).
      vocab_size: V.
      eos_token_ids: the model's end-of-sequence ids.
    """

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class NewRow:
    """A sequence's first step on a worker row.

    Attributes:
      row: the row index in ``[0, max_num_seqs)``.
      token_ids: i32[P], every known token: the prompt, then (for a resumed,
        preempted sequence) the tokens generated before.
      num_prompt_tokens: how many of ``token_ids`` are prompt (for penalties).
      sampling_params: the sequence's parameters (``n`` is ignored; the seed
        is ``seed`` below).
      seed: the per-sequence seed, or None to draw from the server key.
      block_ids: i32[nb], the row's first blocks (prefix-cache hits first).
    """

    row: int
    token_ids: np.ndarray  # [P] i32
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int | None
    block_ids: np.ndarray  # [nb] i32

    def __post_init__(self) -> None:
        _i32("token_ids", self.token_ids)
        _i32("block_ids", self.block_ids)
        if not 0 < self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(f"num_prompt_tokens {self.num_prompt_tokens} outside "
                             f"(0, {len(self.token_ids)}]")


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: row diffs, the schedule and the bucket. See the module docstring.

    Attributes:
      step_id: increasing step counter (for logs and result matching).
      freed_rows: i32[F], applied first.
      new_rows: the rows that start this step, applied second.
      append_rows: i32[A] the row of each appended block, applied third.
      append_block_ids: i32[A] the appended block ids, in order per row.
      rows: i32[n] the rows that run, in token order (a row appears once).
      num_computed: i32[n] tokens of each row already in the KV cache; the
        row's query tokens are its token ids at positions
        ``num_computed .. num_computed + num_tokens - 1``.
      num_tokens: i32[n] query tokens of each row, >= 1, its drafts included.
      sample: bool[n] whether the row samples the token after its last one.
      num_tokens_bucket: T >= num_tokens.sum(), on the T ladder.
      num_reqs_bucket: R >= s (the sampling slots), on the R ladder; 0 when
        no row samples (the logits and sampler are skipped).
      token_bitmask: i32[s, W] (W = ceil(V / 32)), the allowed tokens of each
        sampling slot in plan order (structured outputs; bit t % 32 of word
        t // 32; an unconstrained row is all ones), or None when no sampling
        row is constrained. The worker then runs a masked sampler variant.
      num_draft: i32[n] draft tokens ending each row's query (0 for a row
        that does not sample), or None when the plan has none.
      draft_token_ids: i32[D] those drafts, in plan order (None with
        ``num_draft``). A draft is a query token the worker did not know.
    """

    step_id: int
    freed_rows: np.ndarray  # [F] i32
    new_rows: tuple[NewRow, ...]
    append_rows: np.ndarray  # [A] i32
    append_block_ids: np.ndarray  # [A] i32
    rows: np.ndarray  # [n] i32
    num_computed: np.ndarray  # [n] i32
    num_tokens: np.ndarray  # [n] i32
    sample: np.ndarray  # [n] bool
    num_tokens_bucket: int
    num_reqs_bucket: int
    token_bitmask: np.ndarray | None = None  # [s, W] i32
    num_draft: np.ndarray | None = None  # [n] i32
    draft_token_ids: np.ndarray | None = None  # [D] i32

    def __post_init__(self) -> None:
        for name in ("freed_rows", "append_rows", "append_block_ids", "rows", "num_computed",
                     "num_tokens"):
            _i32(name, getattr(self, name))
        n = len(self.rows)
        if not (len(self.num_computed) == len(self.num_tokens) == len(self.sample) == n):
            raise ValueError("rows, num_computed, num_tokens and sample need one entry per row")
        if len(self.append_rows) != len(self.append_block_ids):
            raise ValueError("append_rows and append_block_ids differ in length")
        if self.sample.dtype != np.bool_:
            raise ValueError(f"sample must be bool, got {self.sample.dtype}")
        if (self.num_draft is None) != (self.draft_token_ids is None):
            raise ValueError("num_draft and draft_token_ids come together")
        if self.num_draft is not None:
            _i32("num_draft", self.num_draft)
            _i32("draft_token_ids", self.draft_token_ids)
            d = self.num_draft
            if (len(d) != n or (d < 0).any() or (d[~self.sample] != 0).any()
                    or (d >= self.num_tokens).any() or d.sum() != len(self.draft_token_ids)):
                raise ValueError(f"num_draft {d.tolist()} does not fit the sampling rows' "
                                 f"num_tokens or the {len(self.draft_token_ids)} drafts")
        if self.token_bitmask is not None:
            _i32("token_bitmask", self.token_bitmask, ndim=2)
            if len(self.token_bitmask) != self.num_sampled:
                raise ValueError(f"token_bitmask has {len(self.token_bitmask)} rows for "
                                 f"{self.num_sampled} sampling slots")

    @property
    def total_tokens(self) -> int:
        """Real (unpadded) tokens in the step."""
        return int(self.num_tokens.sum())

    @property
    def num_sampled(self) -> int:
        """s, the sampling slots: one per sampling row, plus one per draft."""
        return int(self.sample.sum()) + (0 if self.num_draft is None else int(self.num_draft.sum()))

    def slots_per_row(self) -> np.ndarray:
        """i32[n] each row's sampling slots: 1 + its drafts if it samples, else 0."""
        drafts = 0 if self.num_draft is None else self.num_draft
        return (self.sample * (1 + drafts)).astype(_I32)


@dataclasses.dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The prompt logprobs one step computed: one entry per prompt token scored.

    A row whose ``NewRow.sampling_params.prompt_logprobs`` is N (not None)
    scores, for each of its query tokens at position p with p + 1 < its
    ``num_prompt_tokens``, the prompt token at p + 1 given the tokens before
    it: log_softmax of the raw logits (vLLM's prompt logprobs). Entries are
    in token order.

    Attributes:
      index: i32[p] each entry's row as an index into the plan's ``rows``.
      position: i32[p] the scored token's position in its row (>= 1).
      logprob: f32[p] that token's logprob.
      rank: i32[p] its rank, 1 = most likely.
      top_token_ids: i32[p, NL] the top N ids, -1 past the row's N.
      top_logprobs: f32[p, NL] their logprobs, descending.
    """

    index: np.ndarray  # [p] i32
    position: np.ndarray  # [p] i32
    logprob: np.ndarray  # [p] f32
    rank: np.ndarray  # [p] i32
    top_token_ids: np.ndarray  # [p, NL] i32
    top_logprobs: np.ndarray  # [p, NL] f32


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """The worker's answer to a ``StepPlan``: one entry per sampling slot.

    Entries follow the plan's rows with ``sample`` set, in plan order, a row
    with drafts taking ``1 + num_draft`` consecutive entries (its slots).
    The logprob arrays are None when no sampling row asked for logprobs.

    Attributes:
      step_id: the plan's step id.
      token_ids: i32[s] sampled tokens. A row's output is its first
        ``1 + num_accepted`` slots' tokens: the drafts it accepted (each
        equal to the draft), then the token sampled after them.
      logprob: f32[s] the sampled token's logprob (NaN where not asked).
      rank: i32[s] its rank, 1 = most likely (-1 where not asked).
      top_token_ids: i32[s, NL] top-N ids, -1 past a row's N.
      top_logprobs: f32[s, NL] their logprobs, descending.
      prompt_logprobs: what the step's prompt-logprob rows scored, or None
        when no row of the plan asked for prompt logprobs.
      num_accepted: i32[sampling rows] the drafts each sampling row accepted,
        or None when the plan had no drafts.
      draft_token_ids: i32[sampling rows, k] each sampling row's draft model
        proposal for its next step (greedy tokens after its new last token),
        or None without a draft model (``WorkerInit.draft_model``).
      execute_seconds: the worker's time for the plan: its host work up to
        the dispatch (diffs, validation, the packed buffer and its upload)
        plus ``device_seconds``, seconds; 0 when not measured.
      device_seconds: from the step's start on the device — its dispatch,
        or the previous step's results reaching the host if later (steps
        run in dispatch order; with dispatch ahead a step waits behind the
        one before) — to its results being on the host, seconds; 0 when not
        measured.
    """

    step_id: int
    token_ids: np.ndarray  # [s] i32
    logprob: np.ndarray | None = None  # [s] f32
    rank: np.ndarray | None = None  # [s] i32
    top_token_ids: np.ndarray | None = None  # [s, NL] i32
    top_logprobs: np.ndarray | None = None  # [s, NL] f32
    prompt_logprobs: PromptLogprobs | None = None
    num_accepted: np.ndarray | None = None  # [sampling rows] i32
    draft_token_ids: np.ndarray | None = None  # [sampling rows, k] i32
    execute_seconds: float = 0.0
    device_seconds: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerStatus:
    """What a worker reports about itself (health, compile counters).

    Attributes:
      ready: ``initialize`` has completed and the worker accepts plans.
      platform: the JAX platform ("cpu", "gpu", ...); "" before initialize.
      num_executables: step executables compiled or loaded at start-up.
      compile_seconds: wall time of that warm-up, seconds.
      num_cache_hits: of those, loaded from the persistent compilation cache.
      num_recompiles: compiles after warm-up (0 in a healthy server).
      num_steps: plans executed.
    """

    ready: bool
    platform: str = ""
    num_executables: int = 0
    compile_seconds: float = 0.0
    num_cache_hits: int = 0
    num_recompiles: int = 0
    num_steps: int = 0


class WorkerDiedError(RuntimeError):
    """The worker process is gone (killed, crashed, unreachable).

    Raised by a remote worker's ``execute`` / ``initialize``; fatal for the
    engine: the request in flight and every unfinished request fail with it.
    """


class RecompileError(RuntimeError):
    """A step compiled a new executable after warm-up (strict mode only)."""


class Worker(Protocol):
    """The worker interface: ``InProcessWorker`` (same process), ``GrpcWorker`` (a worker process).

    Plans are executed in step order, one at a time. A worker may also offer
    ``submit(plan)``: ``execute`` without waiting, returning an object whose
    ``result()`` is the ``StepResult`` (``InProcessWorker``: a
    ``PendingStep``, the step dispatched to the device; ``GrpcWorker``: a
    ``concurrent.futures.Future``), used by async scheduling to dispatch
    step N + 1 before step N's tokens are read.
    """

    def initialize(self, init: WorkerInit) -> Geometry:
        """Loads the model and allocates the KV cache and the rows."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Applies the plan's row diffs, runs the step, returns the sampled tokens.

        A remote worker raises ``WorkerDiedError`` when it is gone.
        """

    def shutdown(self) -> None:
        """Releases the device state."""
