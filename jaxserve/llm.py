"""``jaxserve.LLM``: the offline API, shaped like vLLM's ``LLM``.

The tokenizer and the engine core (``jaxserve.engine``) run in the caller's
process; the worker runs in it too (``jaxserve.worker.InProcessWorker``, the
default) or in its own process over gRPC (``worker="grpc"``: what the server
runs)::

    llm = LLM()                                       # the demo model
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8))
    outs = llm.chat([{"role": "user", "content": "Hi"}])

``generate`` runs every request to completion and returns the
``RequestOutput``s in input order. Without ``SamplingParams`` it uses
``get_default_sampling_params()``: the model's ``generation_config.json``
defaults (``jaxserve.generation_config``, as vLLM's ``LLM``); the engine caps
``max_tokens`` at the room the prompt leaves. Detokenization and stop strings
are done here, per completion, by ``jaxserve.api.incremental_output`` (the same
code the api process uses): when a stop string matches, the completion is
aborted in the engine and finishes with reason "stop".
"""

from __future__ import annotations

import itertools
import logging
import numbers
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxserve.api.incremental_output import IncrementalOutput
from jaxserve.api.prompts import template_messages
from jaxserve.engine import (CacheConfig, EngineConfig, EngineCore, EngineCoreOutput,
                             EngineCoreRequest, EngineStats, SchedulerConfig)
from jaxserve.engine.config import CompileConfig, SpeculativeConfig
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput, finite_logprob
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int] | Mapping[str, Any]


def _default_compilation_cache_dir() -> str | None:
    """``$JAXSERVE_CACHE/jax_cache`` unless JAX already has a cache directory (then None)."""
    from jaxserve.demo_model import cache_root

    jax = sys.modules.get("jax")
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or (
            jax is not None and jax.config.jax_compilation_cache_dir):
        return None
    return str(cache_root() / "jax_cache")


class LLM:
    """An offline engine over one model.

    Args:
      model: a Hugging Face model directory; None = the demo model
        (SmolLM2-135M-Instruct, built on first use).
      tokenizer: a tokenizer directory; None = the model's.
      dtype: "auto" (default, as vLLM's: float32 on a CPU, bfloat16 on a GPU or
        TPU), "float32" or "bfloat16".
      max_model_len: longest sequence in tokens; None = the model's maximum.
      max_num_seqs: most sequences running at once.
      max_num_batched_tokens: the token budget of one step.
      block_size: tokens per KV block.
      num_kv_blocks: KV blocks including the null block; None = from
        ``kv_cache_bytes``.
      kv_cache_bytes: KV cache budget when ``num_kv_blocks`` is None.
      enable_prefix_caching: share full prompt blocks between requests.
      enable_chunked_prefill: split long prompts over steps.
      token_buckets, request_buckets: the (T, R) ladders; () = defaults.
      attention_backend: None = the platform default.
      seed: the server seed for unseeded sampling.
      async_scheduling: plan each step while the previous one runs
        (``jaxserve.engine.core``; default on, as the server's and vLLM's).
      scan_layers: run the layers with ``jax.lax.scan`` over stacked weights
        (compiles ~4× faster; decodes ~1.3× slower on the CPU: docs/model.md).
      tensor_parallel_size: devices the model and KV cache are split over
        (docs/scale_out.md); the model's heads must split over them.
      load_format: "auto", "safetensors" or "orbax" (``WorkerInit.load_format``).
      quantization: None, "int8", "int4" or "fp8" (vLLM's argument): weight quantized at
        load time — int8 with a float32 scale per output channel, int4 with a float32
        scale per group of 32 inputs (one device only), or fp8: e4m3 weights with a
        float32 scale per output channel and e4m3 activations scaled per token (a GPU
        of compute capability >= 8.9 only; refused elsewhere) (docs/model.md). A
        compressed-tensors fp8 checkpoint (vLLM's ``*-FP8`` models) is fp8 with None or
        "fp8", its stored e4m3 weights taken as they are; other methods are refused.
      kv_cache_dtype: "auto" (the KV cache in ``dtype``), "fp8" or "fp8_e4m3" (vLLM's
        argument): keys and values stored as e4m3 with a scale per layer, 1 byte an
        element, so the cache holds 2× a bfloat16 one's tokens (4× float32's) in the
        same bytes (``jaxserve.model.kv_cache``; docs/kv_cache.md).
      speculative_config: speculative decoding (vLLM's argument): a dict such as
        ``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}``
        or a ``SpeculativeConfig``; None = off (docs/speculative_decoding.md).
      compilation_cache_dir: JAX's persistent compilation cache directory;
        None = JAX's setting (``JAX_COMPILATION_CACHE_DIR`` or
        ``jax.config``) when there is one, else ``$JAXSERVE_CACHE/jax_cache``
        — the same default as ``jaxserve serve``, so either loads what the
        other compiled.
      strict_recompile: a compile after warm-up raises (tests).
      generation_config: where default sampling parameters come from:
        "auto" = the model's ``generation_config.json``, "vllm" =
        ``SamplingParams()``, or a directory holding a generation_config.json
        (``jaxserve.generation_config``).
      worker: None or "in_process" = a new ``InProcessWorker``; "grpc" = a
        new worker process (``python -m jaxserve.worker.server``, stopped by
        ``shutdown``); or a ``jaxserve.step_plan.Worker`` (tests pass one
        holding an already loaded model).

    Raises:
      FileNotFoundError: the model directory lacks its weights or the
        tokenizer directory its tokenizer files (``jaxserve.model_files``),
        or ``generation_config`` names a directory without the file.
      ValueError: invalid configuration (see ``jaxserve.engine.config``), or
        a generation config value ``SamplingParams`` rejects.
      WorkerDiedError: (from ``generate`` / ``chat``) the worker process died;
        the LLM cannot be used any more.
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 dtype: str = "auto", max_model_len: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_bytes: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 token_buckets: Sequence[int] = (), request_buckets: Sequence[int] = (),
                 attention_backend: str | None = None, seed: int = 0,
                 async_scheduling: bool = True, scan_layers: bool = False,
                 tensor_parallel_size: int = 1, load_format: str = "auto",
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 speculative_config: dict | SpeculativeConfig | None = None,
                 compilation_cache_dir: str | None = None,
                 strict_recompile: bool = False, generation_config: str = "auto",
                 worker: Any = None):
        from jaxserve.demo_model import resolve_model_path
        from jaxserve.generation_config import load_sampling_defaults
        from jaxserve.model_files import check_model_files

        path = resolve_model_path(model)
        check_model_files(path, tokenizer_dir=tokenizer)
        self.model_path = path
        self.default_sampling = load_sampling_defaults(path, generation_config)
        if compilation_cache_dir is None:
            compilation_cache_dir = _default_compilation_cache_dir()
        config = EngineConfig(
            model=str(path), dtype=dtype, max_model_len=max_model_len,
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                token_buckets=tuple(token_buckets), request_buckets=tuple(request_buckets)),
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                              kv_cache_bytes=kv_cache_bytes,
                              enable_prefix_caching=enable_prefix_caching,
                              kv_cache_dtype=kv_cache_dtype),
            attention_backend=attention_backend, seed=seed, async_scheduling=async_scheduling,
            scan_layers=scan_layers, tensor_parallel_size=tensor_parallel_size,
            load_format=load_format, quantization=quantization,
            tokenizer=str(tokenizer or path),
            speculative_config=_checked(SpeculativeConfig.of(speculative_config)),
            compile=CompileConfig(cache_dir=compilation_cache_dir,
                                  strict_recompile=strict_recompile))
        if worker is None or worker == "in_process":
            from jaxserve.worker import InProcessWorker

            worker = InProcessWorker()
        elif worker == "grpc":
            from jaxserve.engine.grpc_worker import start_worker_process

            worker = start_worker_process(compilation_cache_dir=compilation_cache_dir)
        try:
            self.engine = EngineCore(config, worker)
        except BaseException:
            worker.shutdown()
            raise
        self.tokenizer = _load_tokenizer(tokenizer or path)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ API
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``chat`` use without ``sampling_params``: ``SamplingParams``
        with the model's generation-config defaults (``generation_config`` argument)."""
        return SamplingParams.from_dict(self.default_sampling)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates completions for one prompt or a list of prompts.

        Args:
          prompts: a string, a list of token ids, a dict with "prompt" or
            "prompt_token_ids" (vLLM's TextPrompt / TokensPrompt), or a list
            of any of these.
          sampling_params: one for all prompts, one per prompt, or None for
            ``get_default_sampling_params()``.
          use_tqdm: show a progress bar.

        Returns:
          One ``RequestOutput`` per prompt, in order.

        Any exception (``KeyboardInterrupt`` too) raised while it runs aborts
        this call's requests before it propagates: the engine is left empty,
        every KV block free, and the next call starts clean.

        Raises:
          jaxserve.validation.InvalidArgument: (a ``ValueError``) a prompt or
            its parameters refused by the engine's one validation
            (``jaxserve.validation.RequestLimits``: empty, too long, ids
            outside the vocabulary, more stop ids or logit-bias entries than
            the sampler holds, ``n`` above ``max_num_seqs``), naming the
            field as ``prompts[i]`` or ``sampling_params.<name>``; nothing is
            queued then.
          ValueError: a params list of the wrong length.
        """
        items = _as_prompt_list(prompts)
        texts, token_ids = zip(*(self._tokenize(p) for p in items)) if items else ((), ())
        return self._run(list(texts), list(token_ids), sampling_params, use_tqdm)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             tools: Sequence[Mapping[str, Any]] | None = None) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them.

        Each conversation is a list of OpenAI-shaped messages ({"role",
        "content"}, an assistant's "tool_calls", a tool's "tool_call_id"),
        rendered with the tokenizer's chat template (or ``chat_template``) and
        tokenized without adding special tokens again; ``tools``
        (``[{"type": "function", "function": {"name", "description",
        "parameters"}}]``) go to the template as ``tools``, as in vLLM's
        ``LLM.chat``: the replies are text, not parsed for calls (a call can
        be forced with ``structured_outputs``; docs/tool_calling.md).
        Exceptions leave the engine empty, as in ``generate``.

        Raises:
          ValueError: a call's arguments that are not JSON text of an object
            (``messages[i].tool_calls[j].function.arguments``).
        """
        conversations = ([messages] if messages and isinstance(messages[0], Mapping)
                         else list(messages))
        texts, ids = [], []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                template_messages(conv), tools=list(tools) if tools else None, tokenize=False,
                add_generation_prompt=add_generation_prompt, chat_template=chat_template)
            texts.append(text)
            ids.append(self._encode(text, "messages", add_special_tokens=False))
        return self._run(texts, ids, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------ internals
    def _encode(self, text: str, field: str, **kwargs: Any) -> list[int]:
        """The tokenizer's ids of ``text``; ValueError naming ``field`` for text without UTF-8."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"{field}: not valid Unicode text ({err.reason} at index "
                             f"{err.start})") from None
        # verbose=False: the engine's limits refuse an over-long prompt with its
        # field; transformers' "indexing errors" warning is not ours to give.
        return list(self.tokenizer.encode(text, verbose=False, **kwargs))

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, "prompt")
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return prompt["prompt"], self._encode(prompt["prompt"], "prompt")
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got {sorted(prompt)}")
        return None, [int(t) for t in prompt]

    def _run(self, texts: list[str | None], token_ids: list[list[int]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(texts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(texts):
            raise ValueError(f"got {len(params)} sampling params for {len(texts)} prompts")
        for i, (ids, sp) in enumerate(zip(token_ids, params)):  # all, before queuing any
            self.engine.limits.check(ids, sp, prompt_field=f"prompts[{i}]")
            self.engine.check_structured_outputs(sp)  # a bad schema / regex / grammar
        requests = {}
        try:
            for text, ids, sp in zip(texts, token_ids, params):
                rid = str(next(self._ids))
                self.engine.add_request(EngineCoreRequest(rid, ids, sp, time.time()))
                requests[rid] = _Pending(rid, text, ids, sp, self.tokenizer)
            self._step_until_finished(requests, _progress(len(requests), use_tqdm))
        except BaseException:
            # An error or a KeyboardInterrupt leaves nothing of this call in the
            # engine: its blocks are freed and the next call starts clean.
            self.engine.abort_requests(list(requests))
            raise
        return [p.result() for p in requests.values()]

    def _step_until_finished(self, requests: dict[str, "_Pending"], bar: Any) -> None:
        """Steps the engine until every request in ``requests`` has finished."""
        unfinished = len(requests)
        try:
            while unfinished:
                for out in self.engine.step():
                    pending = requests[out.request_id]
                    stopped = pending.accept(out)
                    if stopped:
                        self.engine.abort_requests([(out.request_id, out.index)])
                    if pending.finished:
                        unfinished -= 1
                        if bar is not None:
                            bar.update(1)
                if not self.engine.has_unfinished_requests() and unfinished:
                    raise RuntimeError("the engine finished with requests still pending")
        finally:
            if bar is not None:
                bar.close()


class _Completion:
    """One sample's text, ids, logprobs and finish state."""

    __slots__ = ("out", "logprobs", "finish_reason", "stop_reason")

    def __init__(self, tokenizer: Any, prompt_ids: list[int], sp: SamplingParams):
        self.out = IncrementalOutput(tokenizer, prompt_ids, sp)
        self.logprobs: list[dict[int, Logprob]] | None = [] if sp.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class _Pending:
    """Collects a request's engine outputs into a ``RequestOutput``."""

    def __init__(self, rid: str, text: str | None, ids: list[int], sp: SamplingParams,
                 tokenizer: Any):
        self.rid, self.text, self.ids, self.tokenizer = rid, text, ids, tokenizer
        self.completions = [_Completion(tokenizer, ids, sp) for _ in range(sp.n)]
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.num_cached_tokens = 0
        self.num_unfinished = sp.n

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def accept(self, out: EngineCoreOutput) -> bool:
        """Takes one engine output; True when a stop string ended the completion."""
        c = self.completions[out.index]
        if out.index == 0:
            self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:  # vLLM's form: None for the first token
            self.prompt_logprobs = [None] + [self._logprob_dict(t, lp) for t, lp in zip(
                self.ids[1:], out.prompt_logprobs)]
        if c.logprobs is not None and out.new_logprobs:
            c.logprobs.extend(self._logprob_dict(t, lp)
                              for t, lp in zip(out.new_token_ids, out.new_logprobs))
        delta = c.out.push(out.new_token_ids, stop_token=out.finish_reason == "stop")
        if delta.stop is not None:
            c.finish_reason, c.stop_reason = "stop", delta.stop
            self.num_unfinished -= 1
            return out.finish_reason is None  # still running in the engine: abort it
        if out.finish_reason is not None:
            delta = c.out.flush()
            c.finish_reason = "stop" if delta.stop is not None else out.finish_reason
            c.stop_reason = delta.stop if delta.stop is not None else out.stop_reason
            self.num_unfinished -= 1
        return False

    def _logprob_dict(self, token_id: int, lp) -> dict[int, Logprob]:
        decode = lambda t: self.tokenizer.decode([t])  # noqa: E731
        entries = {int(t): Logprob(finite_logprob(v), i + 1, decode(t))
                   for i, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
        entries[int(token_id)] = Logprob(finite_logprob(lp.logprob), int(lp.rank),
                                         decode(token_id))
        return entries

    def result(self) -> RequestOutput:
        outputs = []
        for i, c in enumerate(self.completions):
            ids = c.out.token_ids
            logprobs = None if c.logprobs is None else c.logprobs[:len(ids)]
            cumulative = None if logprobs is None else sum(
                lp[t].logprob for t, lp in zip(ids, logprobs))
            outputs.append(CompletionOutput(i, c.out.text, ids, c.finish_reason, logprobs,
                                            c.stop_reason, cumulative))
        return RequestOutput(self.rid, self.text, list(self.ids), outputs, self.finished,
                             self.num_cached_tokens, self.prompt_logprobs)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, numbers.Integral) for p in prompts):  # one prompt of ids
        return [prompts]
    return prompts


def _load_tokenizer(path: Any) -> Any:
    from transformers import AutoTokenizer  # heavy import, kept local

    return AutoTokenizer.from_pretrained(str(path))


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req")


def _checked(spec: SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A draft model's directory checked before anything loads (``with_model_checked``)."""
    return None if spec is None else spec.with_model_checked()
