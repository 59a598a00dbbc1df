"""``jaxserve.step_plan`` dataclasses <-> ``proto/jaxserve/worker.proto`` messages (jax-free).

Every array travels as raw little-endian bytes (``np.ndarray.tobytes`` of a
``<i4`` / ``<f4`` / ``u1`` array; ``np.frombuffer`` back, a read-only view of
the message's bytes, no copy), so a decode step's plan is a few bytes per
scheduled row: ``rows``, ``num_computed``, ``num_tokens`` (4 bytes each)
and ``sample`` (1 byte), plus one appended block id (8 bytes with its row)
every S steps. Sampling parameters travel as JSON (only in a ``NewRow``,
once per sequence), which keeps any-size integer seeds and float values
exact.

Decoding validates like the dataclasses do (``StepPlan.__post_init__``):
a byte count that is not a whole number of elements raises ValueError.
"""

from __future__ import annotations

import json

import numpy as np

from jaxserve.proto import worker_pb2 as wpb
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import (Geometry, NewRow, PromptLogprobs, StepPlan, StepResult,
                                WorkerInit, WorkerStatus)

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")


# ------------------------------------------------------------------ arrays
def _to_bytes(arr: np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(arr, dtype=dtype).tobytes()


def _from_bytes(name: str, data: bytes, dtype: np.dtype, width: int = 0) -> np.ndarray:
    if len(data) % dtype.itemsize or (width and len(data) % (dtype.itemsize * width)):
        raise ValueError(f"{name}: {len(data)} bytes is not a whole number of "
                         f"{dtype.itemsize * max(width, 1)}-byte elements")
    arr = np.frombuffer(data, dtype)
    arr = arr.astype(dtype.newbyteorder("="), copy=False)  # native order (a no-op on x86/ARM)
    return arr.reshape(-1, width) if width else arr


def _i32(name: str, data: bytes) -> np.ndarray:
    return _from_bytes(name, data, _I32)


# --------------------------------------------------------- sampling params
def sampling_to_json(params: SamplingParams, seed: int | None) -> str:
    """A ``NewRow``'s parameters and seed as JSON (logit_bias as [[id, bias], ...])."""
    d = params.to_dict()
    if d["logit_bias"] is not None:
        d["logit_bias"] = [[int(k), float(v)] for k, v in d["logit_bias"].items()]
    return json.dumps({"params": d, "seed": seed}, allow_nan=False, separators=(",", ":"))


def sampling_from_json(text: str) -> tuple[SamplingParams, int | None]:
    """Inverse of ``sampling_to_json``. Raises ValueError on bad JSON or parameters."""
    data = json.loads(text)
    d = dict(data["params"])
    if d.get("logit_bias") is not None:
        d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"]}
    return SamplingParams.from_dict(d), data["seed"]


# ----------------------------------------------------------------- messages
def init_to_proto(init: WorkerInit) -> wpb.InitializeRequest:
    msg = wpb.InitializeRequest(
        dtype=init.dtype, block_size=init.block_size, max_num_seqs=init.max_num_seqs,
        token_buckets=list(init.token_buckets), request_buckets=list(init.request_buckets),
        seed_json=json.dumps(int(init.seed)), memory_utilization=init.memory_utilization,
        precompile=init.precompile, strict_recompile=init.strict_recompile,
        scan_layers=init.scan_layers, tensor_parallel_size=init.tensor_parallel_size,
        load_format=init.load_format, num_speculative_tokens=init.num_speculative_tokens,
        kv_cache_dtype=init.kv_cache_dtype)
    for field in ("model", "num_kv_blocks", "kv_cache_bytes", "max_model_len",
                  "attention_backend", "compilation_cache_dir", "quantization", "draft_model"):
        value = getattr(init, field)
        if value is not None:
            setattr(msg, field, value)
    return msg


def init_from_proto(msg: wpb.InitializeRequest) -> WorkerInit:
    opt = lambda f: getattr(msg, f) if msg.HasField(f) else None  # noqa: E731
    return WorkerInit(
        model=opt("model"), dtype=msg.dtype, block_size=msg.block_size,
        num_kv_blocks=opt("num_kv_blocks"), kv_cache_bytes=opt("kv_cache_bytes"),
        max_num_seqs=msg.max_num_seqs, max_model_len=opt("max_model_len"),
        token_buckets=tuple(msg.token_buckets), request_buckets=tuple(msg.request_buckets),
        attention_backend=opt("attention_backend"), seed=int(json.loads(msg.seed_json)),
        memory_utilization=msg.memory_utilization, precompile=msg.precompile,
        strict_recompile=msg.strict_recompile,
        compilation_cache_dir=opt("compilation_cache_dir"), scan_layers=msg.scan_layers,
        tensor_parallel_size=msg.tensor_parallel_size or 1, load_format=msg.load_format or "auto",
        quantization=opt("quantization"), draft_model=opt("draft_model"),
        num_speculative_tokens=msg.num_speculative_tokens,
        kv_cache_dtype=msg.kv_cache_dtype or "auto")


def geometry_to_proto(g: Geometry) -> wpb.Geometry:
    return wpb.Geometry(num_kv_blocks=g.num_kv_blocks, block_size=g.block_size,
                        max_model_len=g.max_model_len, vocab_size=g.vocab_size,
                        eos_token_ids=list(g.eos_token_ids))


def geometry_from_proto(msg: wpb.Geometry) -> Geometry:
    return Geometry(num_kv_blocks=msg.num_kv_blocks, block_size=msg.block_size,
                    max_model_len=msg.max_model_len, vocab_size=msg.vocab_size,
                    eos_token_ids=tuple(msg.eos_token_ids))


def plan_to_proto(plan: StepPlan) -> wpb.StepPlan:
    """The wire form of a plan (see the module docstring for the sizes)."""
    mask = plan.token_bitmask
    return wpb.StepPlan(
        step_id=plan.step_id,
        freed_rows=_to_bytes(plan.freed_rows, _I32),
        new_rows=[wpb.NewRow(row=n.row, token_ids=_to_bytes(n.token_ids, _I32),
                             num_prompt_tokens=n.num_prompt_tokens,
                             sampling_json=sampling_to_json(n.sampling_params, n.seed),
                             block_ids=_to_bytes(n.block_ids, _I32))
                  for n in plan.new_rows],
        append_rows=_to_bytes(plan.append_rows, _I32),
        append_block_ids=_to_bytes(plan.append_block_ids, _I32),
        rows=_to_bytes(plan.rows, _I32),
        num_computed=_to_bytes(plan.num_computed, _I32),
        num_tokens=_to_bytes(plan.num_tokens, _I32),
        sample=_to_bytes(plan.sample, _U8),
        num_tokens_bucket=plan.num_tokens_bucket,
        num_reqs_bucket=plan.num_reqs_bucket,
        token_bitmask=b"" if mask is None else _to_bytes(mask, _I32),
        token_bitmask_words=0 if mask is None else mask.shape[1],
        **({} if plan.num_draft is None else dict(
            has_drafts=True, num_draft=_to_bytes(plan.num_draft, _I32),
            draft_token_ids=_to_bytes(plan.draft_token_ids, _I32))))


def plan_from_proto(msg: wpb.StepPlan) -> StepPlan:
    """Inverse of ``plan_to_proto``. Raises ValueError on malformed arrays or parameters."""
    new_rows = []
    for n in msg.new_rows:
        params, seed = sampling_from_json(n.sampling_json)
        new_rows.append(NewRow(row=n.row, token_ids=_i32("token_ids", n.token_ids),
                               num_prompt_tokens=n.num_prompt_tokens, sampling_params=params,
                               seed=seed, block_ids=_i32("block_ids", n.block_ids)))
    return StepPlan(
        step_id=msg.step_id,
        freed_rows=_i32("freed_rows", msg.freed_rows),
        new_rows=tuple(new_rows),
        append_rows=_i32("append_rows", msg.append_rows),
        append_block_ids=_i32("append_block_ids", msg.append_block_ids),
        rows=_i32("rows", msg.rows),
        num_computed=_i32("num_computed", msg.num_computed),
        num_tokens=_i32("num_tokens", msg.num_tokens),
        sample=_from_bytes("sample", msg.sample, _U8).astype(np.bool_),
        num_tokens_bucket=msg.num_tokens_bucket,
        num_reqs_bucket=msg.num_reqs_bucket,
        token_bitmask=_from_bytes("token_bitmask", msg.token_bitmask, _I32,
                                  msg.token_bitmask_words)
        if msg.token_bitmask_words else None,
        num_draft=_i32("num_draft", msg.num_draft) if msg.has_drafts else None,
        draft_token_ids=_i32("draft_token_ids", msg.draft_token_ids) if msg.has_drafts else None)


def result_to_proto(result: StepResult) -> wpb.StepResult:
    msg = wpb.StepResult(step_id=result.step_id, token_ids=_to_bytes(result.token_ids, _I32),
                         execute_seconds=result.execute_seconds,
                         device_seconds=result.device_seconds)
    if result.num_accepted is not None:
        msg.has_num_accepted = True
        msg.num_accepted = _to_bytes(result.num_accepted, _I32)
    if result.draft_token_ids is not None:
        msg.num_proposed = result.draft_token_ids.shape[1]
        msg.draft_token_ids = _to_bytes(result.draft_token_ids, _I32)
    if result.logprob is not None:
        msg.has_logprobs = True
        msg.logprob = _to_bytes(result.logprob, _F32)
        msg.rank = _to_bytes(result.rank, _I32)
        msg.num_top_logprobs = result.top_token_ids.shape[1]
        msg.top_token_ids = _to_bytes(result.top_token_ids, _I32)
        msg.top_logprobs = _to_bytes(result.top_logprobs, _F32)
    prompt = result.prompt_logprobs
    if prompt is not None:
        msg.prompt_logprobs.CopyFrom(wpb.PromptLogprobs(
            index=_to_bytes(prompt.index, _I32), position=_to_bytes(prompt.position, _I32),
            logprob=_to_bytes(prompt.logprob, _F32), rank=_to_bytes(prompt.rank, _I32),
            num_top_logprobs=prompt.top_token_ids.shape[1],
            top_token_ids=_to_bytes(prompt.top_token_ids, _I32),
            top_logprobs=_to_bytes(prompt.top_logprobs, _F32)))
    return msg


def _top(name: str, data: bytes, dtype: np.dtype, width: int, rows: int) -> np.ndarray:
    """A [rows, width] array of top logprobs or ids (width 0: no bytes on the wire)."""
    return _from_bytes(name, data, dtype, width) if width else np.zeros((rows, 0), dtype)


def _prompt_from_proto(msg: wpb.PromptLogprobs) -> PromptLogprobs:
    index = _i32("prompt_logprobs.index", msg.index)
    width = msg.num_top_logprobs
    return PromptLogprobs(
        index, _i32("prompt_logprobs.position", msg.position),
        _from_bytes("prompt_logprobs.logprob", msg.logprob, _F32),
        _i32("prompt_logprobs.rank", msg.rank),
        _top("prompt_logprobs.top_token_ids", msg.top_token_ids, _I32, width, len(index)),
        _top("prompt_logprobs.top_logprobs", msg.top_logprobs, _F32, width, len(index)))


def result_from_proto(msg: wpb.StepResult) -> StepResult:
    """Inverse of ``result_to_proto``. Raises ValueError on malformed arrays."""
    token_ids = _i32("token_ids", msg.token_ids)
    prompt = (_prompt_from_proto(msg.prompt_logprobs) if msg.HasField("prompt_logprobs")
              else None)
    accepted = _i32("num_accepted", msg.num_accepted) if msg.has_num_accepted else None
    proposed = (_from_bytes("draft_token_ids", msg.draft_token_ids, _I32, msg.num_proposed)
                if msg.num_proposed else None)
    if not msg.has_logprobs:
        return StepResult(msg.step_id, token_ids, prompt_logprobs=prompt, num_accepted=accepted,
                          draft_token_ids=proposed, execute_seconds=msg.execute_seconds, device_seconds=msg.device_seconds)
    width = msg.num_top_logprobs
    return StepResult(msg.step_id, token_ids, _from_bytes("logprob", msg.logprob, _F32),
                      _i32("rank", msg.rank),
                      _top("top_token_ids", msg.top_token_ids, _I32, width, len(token_ids)),
                      _top("top_logprobs", msg.top_logprobs, _F32, width, len(token_ids)),
                      prompt_logprobs=prompt, num_accepted=accepted,
                      draft_token_ids=proposed, execute_seconds=msg.execute_seconds,
                      device_seconds=msg.device_seconds)


def status_to_proto(s: WorkerStatus) -> wpb.WorkerStatus:
    return wpb.WorkerStatus(ready=s.ready, platform=s.platform,
                            num_executables=s.num_executables, compile_seconds=s.compile_seconds,
                            num_cache_hits=s.num_cache_hits, num_recompiles=s.num_recompiles,
                            num_steps=s.num_steps)


def status_from_proto(msg: wpb.WorkerStatus) -> WorkerStatus:
    return WorkerStatus(ready=msg.ready, platform=msg.platform,
                        num_executables=msg.num_executables, compile_seconds=msg.compile_seconds,
                        num_cache_hits=msg.num_cache_hits, num_recompiles=msg.num_recompiles,
                        num_steps=msg.num_steps)
