"""What ``jaxserve.LLM`` returns, shaped like vLLM's ``RequestOutput`` (jax-free)."""

from __future__ import annotations

import dataclasses
import math

# The logprob reported for a token the step could not draw (masked by structured
# outputs: -inf on the device). JSON has no -inf, so the API and ``LLM`` report
# this floor instead, as vLLM's OpenAI serving layer does (its -9999.0).
LOGPROB_FLOOR = -9999.0


def finite_logprob(logprob: float) -> float:
    """``logprob`` as a float, with -inf / NaN (a token that cannot be drawn) as ``LOGPROB_FLOOR``."""
    value = float(logprob)
    return value if math.isfinite(value) else LOGPROB_FLOOR


@dataclasses.dataclass(frozen=True, slots=True)
class Logprob:
    """One token's logprob (vLLM's ``Logprob``).

    Attributes:
      logprob: natural-log probability (from the raw logits, as vLLM V1).
      rank: 1 = the most likely token.
      decoded_token: the token's text.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One completion (one of ``n`` samples) of a request.

    Attributes:
      index: the sample index in [0, n).
      text: the generated text (stop strings cut out unless
        ``include_stop_str_in_output``).
      token_ids: the generated token ids (an EOS / stop token id that ended
        the completion included, as vLLM).
      finish_reason: "stop", "length" or "abort"; None while running.
      logprobs: per generated token, {token id: Logprob} holding the sampled
        token and the top N; None unless ``SamplingParams.logprobs`` was set.
      stop_reason: the stop string or stop token id that ended the
        completion; None for EOS, length or abort.
      cumulative_logprob: sum of the sampled tokens' logprobs when logprobs
        were asked, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's result.

    Attributes:
      request_id: the engine's id of the request.
      prompt: the prompt text (None when given as token ids).
      prompt_token_ids: the prompt's ids.
      outputs: one ``CompletionOutput`` per sample, by index.
      finished: every completion finished.
      num_cached_tokens: prompt tokens served from the prefix cache
        (sample 0's first scheduling).
      prompt_logprobs: with ``SamplingParams.prompt_logprobs`` = N, one entry
        per prompt token (vLLM's form): None for the first, then {token id:
        Logprob} holding the prompt token (its logprob given the tokens
        before it, its rank) and the top N; None when not asked.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
