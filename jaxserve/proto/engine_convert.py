"""Mappings between the internal engine proto (``proto/jaxserve/engine.proto``) and the engine's values.

Used on both sides of the api <-> engine wire: the api process sends
``EngineCoreRequest``s and receives ``EngineCoreOutput``s and ``EngineStats``;
the engine process does the reverse. Every conversion is exact: sampling
parameters travel with every field set (``sampling_params_to_proto`` of a
``SamplingParams``), logprobs as float32 (what the sampler computes).
Jax-free.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxserve.engine.messages import (EngineCoreOutput, EngineCoreRequest, EngineStats,
                                      SampleLogprobs)
from jaxserve.proto import engine_pb2 as epb
from jaxserve.proto.convert import (finish_reason_from_proto, finish_reason_to_proto,
                                    sampling_params_kwargs_from_proto, sampling_params_to_proto)
from jaxserve.sampling_params import SamplingParams


def request_to_proto(request: EngineCoreRequest) -> epb.EngineRequest:
    """The wire form of a tokenized request."""
    message = epb.EngineRequest(
        request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
        sampling_params=sampling_params_to_proto(request.sampling_params),
        arrival_time=request.arrival_time)
    if request.cache_salt is not None:
        message.cache_salt = request.cache_salt
    return message


def request_from_proto(message: epb.EngineRequest) -> EngineCoreRequest:
    """Inverse of ``request_to_proto``.

    Raises:
      ValueError: sampling parameters ``SamplingParams`` rejects (the api
        process validated them, so only a foreign client gets this).
    """
    params = SamplingParams.from_dict(sampling_params_kwargs_from_proto(message.sampling_params))
    salt = message.cache_salt if message.HasField("cache_salt") else None
    return EngineCoreRequest(message.request_id, list(message.prompt_token_ids), params,
                             message.arrival_time, salt)


def add_outputs(container, outputs: Iterable[EngineCoreOutput]) -> None:
    """Appends the wire form of each output to ``container`` (``EngineOutputBatch.outputs``).

    Each message is built in place with only the fields that differ from
    their proto3 defaults (the same bytes as setting them all): with the upb
    runtime that costs a fifth of building full messages and copying them in
    (0.19 vs 0.90 ms for 256 decode outputs), and the engine sends one per
    running sequence per step.
    """
    add = container.add
    for output in outputs:
        message = add(request_id=output.request_id, new_token_ids=output.new_token_ids,
                      num_prompt_tokens=output.num_prompt_tokens)
        if output.index:
            message.index = output.index
        if output.num_cached_tokens:
            message.num_cached_tokens = output.num_cached_tokens
        if output.finish_reason is not None:
            message.finish_reason = finish_reason_to_proto(output.finish_reason)
        if output.stop_reason is not None:
            message.stop_reason = output.stop_reason
        if output.new_logprobs is not None:
            message.has_logprobs = True
            for lp in output.new_logprobs:
                message.new_logprobs.add(logprob=lp.logprob, rank=lp.rank,
                                         top_token_ids=lp.top_token_ids,
                                         top_logprobs=lp.top_logprobs)
        if output.prompt_logprobs is not None:
            message.has_prompt_logprobs = True
            for lp in output.prompt_logprobs:
                message.prompt_logprobs.add(logprob=lp.logprob, rank=lp.rank,
                                            top_token_ids=lp.top_token_ids,
                                            top_logprobs=lp.top_logprobs)


def output_from_proto(message: epb.EngineOutput) -> EngineCoreOutput:
    """One output of ``add_outputs``, back."""
    logprobs = prompt = None
    if message.has_logprobs:
        logprobs = [SampleLogprobs(lp.logprob, lp.rank, tuple(lp.top_token_ids),
                                   tuple(lp.top_logprobs)) for lp in message.new_logprobs]
    if message.has_prompt_logprobs:
        prompt = [SampleLogprobs(lp.logprob, lp.rank, tuple(lp.top_token_ids),
                                 tuple(lp.top_logprobs)) for lp in message.prompt_logprobs]
    return EngineCoreOutput(
        request_id=message.request_id, index=message.index,
        new_token_ids=list(message.new_token_ids), new_logprobs=logprobs,
        finish_reason=finish_reason_from_proto(message.finish_reason),  # type: ignore[arg-type]
        stop_reason=message.stop_reason if message.HasField("stop_reason") else None,
        num_prompt_tokens=message.num_prompt_tokens, num_cached_tokens=message.num_cached_tokens,
        prompt_logprobs=prompt)


def stats_to_proto(stats: EngineStats, *, serving: bool = True,
                   error: str = "") -> epb.EngineStatsResponse:
    """The wire form of an ``EngineStats`` snapshot plus the engine's health."""
    return epb.EngineStatsResponse(
        num_waiting=stats.num_waiting, num_running=stats.num_running,
        kv_blocks_total=stats.kv_blocks_total, kv_blocks_free=stats.kv_blocks_free,
        kv_blocks_cached=stats.kv_blocks_cached, kv_blocks_used=stats.kv_blocks_used,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits, num_preemptions=stats.num_preemptions,
        num_steps=stats.num_steps, num_recompiles=stats.num_recompiles,
        num_worker_restarts=stats.num_worker_restarts,
        spec_decode_num_drafts=stats.spec_decode_num_drafts,
        spec_decode_num_draft_tokens=stats.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens=stats.spec_decode_num_accepted_tokens,
        serving=serving, error=error)


def stats_from_proto(message: epb.EngineStatsResponse) -> EngineStats:
    """The ``EngineStats`` of a ``GetStats`` answer (health fields are read separately)."""
    return EngineStats(
        num_waiting=message.num_waiting, num_running=message.num_running,
        kv_blocks_total=message.kv_blocks_total, kv_blocks_free=message.kv_blocks_free,
        kv_blocks_cached=message.kv_blocks_cached, kv_blocks_used=message.kv_blocks_used,
        prefix_cache_queries=message.prefix_cache_queries,
        prefix_cache_hits=message.prefix_cache_hits, num_preemptions=message.num_preemptions,
        num_steps=message.num_steps, num_recompiles=message.num_recompiles,
        num_worker_restarts=message.num_worker_restarts,
        spec_decode_num_drafts=message.spec_decode_num_drafts,
        spec_decode_num_draft_tokens=message.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens=message.spec_decode_num_accepted_tokens)
