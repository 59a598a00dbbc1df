"""What goes into and comes out of the engine core (vLLM V1's names; jax-free).

``EngineCoreRequest`` is a tokenized request; ``EngineCoreOutput`` is one
sequence's progress in one step. Stop strings and detokenization are not
the engine's job: the output processor matches stop strings on the text and
then aborts the sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

from jaxserve.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """A tokenized request.

    Attributes:
      request_id: unique among unfinished requests.
      prompt_token_ids: the prompt, >= 1 token, each in [0, V).
      sampling_params: ``n > 1`` forks the request into ``n`` sequences
        (indices 0 .. n - 1) that share the prompt's KV blocks.
      arrival_time: seconds (``time.time()``), for metrics.
      cache_salt: isolates this request's prefix-cache entries: only
        requests with the same salt share blocks.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    cache_salt: str | None = None


class SampleLogprobs(NamedTuple):
    """Logprobs of one generated token.

    ``logprob`` is the sampled token's, ``rank`` its rank (1 = most likely),
    ``top_token_ids`` / ``top_logprobs`` the top N (N = SamplingParams.logprobs).
    """

    logprob: float
    rank: int
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


# Not frozen: a frozen dataclass's __init__ sets each field through
# object.__setattr__, 4x slower, and the engine builds one per running
# sequence per step (0.5 vs 0.13 ms for 256). Treat it as read-only.
@dataclasses.dataclass(slots=True)
class EngineCoreOutput:
    """One sequence's new tokens from one step, and whether it finished (read-only by convention).

    Attributes:
      request_id: the request's id.
      index: the sample index in [0, n).
      new_token_ids: tokens generated this step (1 per step today).
      new_logprobs: one ``SampleLogprobs`` per new token when asked, else None.
      finish_reason: None while running; "stop" (EOS or a stop token id),
        "length" (max_tokens or the model's maximum length) or "abort".
      stop_reason: the stop token id that ended the sequence (None for EOS
        and for other finish reasons).
      num_prompt_tokens: the prompt's length.
      num_cached_tokens: prompt tokens found in the prefix cache at the
        sequence's first scheduling.
      prompt_logprobs: with ``SamplingParams.prompt_logprobs`` set, in sample
        0's first output: one ``SampleLogprobs`` per prompt token from the
        second on (P - 1 entries: the prompt token's logprob given the tokens
        before it, its rank and the top N); else None.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[SampleLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[SampleLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's state and counters.

    KV blocks exclude the null block: ``kv_blocks_free + kv_blocks_cached +
    kv_blocks_used == kv_blocks_total``. Free blocks hold no cached prefix;
    cached ones do and may be evicted (LRU) to allocate.
    Prefix-cache counters are in tokens, counted when a sequence is scheduled
    from waiting: ``prefix_cache_queries`` prompt tokens looked up,
    ``prefix_cache_hits`` of them found. Speculative decoding counters (vLLM's
    ``spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens``):
    sequences whose drafts a step verified, the drafts verified, and of them
    accepted; the acceptance rate is accepted / draft tokens, and the mean
    accepted length 1 + accepted / drafts tokens per verifying step.
    """

    num_waiting: int
    num_running: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_used: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_recompiles: int = 0
    num_worker_restarts: int = 0  # worker processes started after the first (EngineLoop)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Drafts accepted / drafts verified (0 before any)."""
        return (self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens
                if self.spec_decode_num_draft_tokens else 0.0)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
