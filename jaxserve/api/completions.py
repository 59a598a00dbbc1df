"""One request's engine outputs -> ``GenerateResponse``s (api process, jax-free).

``RequestTracker`` holds an ``IncrementalOutput`` per completion (sample
index) and turns each ``EngineCoreOutput`` into the responses to send:

- **stream**: one response per engine output that changed the completion
  (new token ids, maybe an empty text delta while a character or a possible
  stop string is held back); the completion's last response carries
  ``finished`` together with its last tokens and text.
  With prompt logprobs (sample 0's first engine output carries them), each
  completion's first response sent afterwards carries them too.
- **non-stream**: one response per completion, when it finishes, with all
  its tokens, its whole text and ``finished``.

A stop string that matches ends the completion here ("stop", the string);
``accept`` then names the completion to abort in the engine. Token ids after
the one that completed a stop string are dropped, with their logprobs.
``abort()`` finishes every unfinished completion with reason "abort" (server
shutdown). Timestamps for the latency metrics are kept per request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from jaxserve.api.incremental_output import IncrementalOutput
from jaxserve.engine.messages import EngineCoreOutput, SampleLogprobs
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto.convert import finish_reason_to_proto
from jaxserve.sampling_params import SamplingParams


class _Completion:
    """One sample's detokenizer and what is not yet sent."""

    __slots__ = ("out", "finished", "ids", "text", "logprobs", "first_token_time", "finish_time",
                 "reason", "prompt_sent")

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams):
        self.out = IncrementalOutput(tokenizer, prompt_ids, params)
        self.finished = False
        self.ids: list[int] = []  # unsent (non-stream: everything)
        self.text: list[str] = []
        self.logprobs: list[pb.TokenLogprobs] = []
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.reason: str | None = None
        self.prompt_sent = False  # the request's prompt logprobs went out in a response


class RequestTracker:
    """Turns one request's engine outputs into responses.

    Args:
      request_id: the request's id (in every response).
      tokenizer: the model's tokenizer.
      prompt_token_ids: the prompt.
      params: the validated ``SamplingParams`` (n completions).
      stream: stream responses per step, or one per completion.
      arrival_time: ``time.monotonic()`` when the request arrived.
    """

    def __init__(self, request_id: str, tokenizer: Any, prompt_token_ids: Sequence[int],
                 params: SamplingParams, *, stream: bool, arrival_time: float) -> None:
        self.request_id = request_id
        self.stream = stream
        self.arrival_time = arrival_time
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[pb.TokenLogprobs] | None = None  # once sample 0 has them
        self.completions = [_Completion(tokenizer, prompt_token_ids, params)
                            for _ in range(params.n)]

    @property
    def done(self) -> bool:
        """Every completion has finished."""
        return all(c.finished for c in self.completions)

    @property
    def first_token_time(self) -> float | None:
        """``time.monotonic()`` of the request's first generated token, or None."""
        times = [c.first_token_time for c in self.completions if c.first_token_time is not None]
        return min(times) if times else None

    def completion_stats(self) -> list[tuple[int, float | None, float | None, str | None]]:
        """Per finished completion: (tokens, first token time, finish time, finish reason)."""
        return [(c.out.num_tokens, c.first_token_time, c.finish_time, c.reason)
                for c in self.completions if c.finished]

    def accept(self, output: EngineCoreOutput) -> tuple[list[pb.GenerateResponse], bool]:
        """Takes one engine output.

        Returns:
          (responses to send, whether to abort this completion in the engine:
          a stop string ended it while the engine still runs it).
        """
        c = self.completions[output.index]
        if c.finished:
            return [], False
        if output.index == 0:
            self.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = [_logprobs(lp) for lp in output.prompt_logprobs]
        before = c.out.num_tokens
        delta = c.out.push(output.new_token_ids, stop_token=output.finish_reason == "stop")
        accepted = output.new_token_ids[:c.out.num_tokens - before]
        if accepted and c.first_token_time is None:
            c.first_token_time = time.monotonic()
        c.ids.extend(accepted)
        c.text.append(delta.text)
        if output.new_logprobs is not None:
            c.logprobs.extend(_logprobs(lp) for lp in output.new_logprobs[:len(accepted)])
        if delta.stop is not None:
            return self._finish(c, output.index, "stop", delta.stop), output.finish_reason is None
        if output.finish_reason is not None:
            rest = c.out.flush()
            c.text.append(rest.text)
            if rest.stop is not None:
                return self._finish(c, output.index, "stop", rest.stop), False
            return self._finish(c, output.index, output.finish_reason, output.stop_reason), False
        if not self.stream or not accepted:
            return [], False
        return [self._take(c, output.index)], False

    def abort(self) -> list[pb.GenerateResponse]:
        """Finishes every unfinished completion with reason "abort"."""
        responses = []
        for index, c in enumerate(self.completions):
            if not c.finished:
                c.text.append(c.out.flush().text)
                responses.extend(self._finish(c, index, "abort", None))
        return responses

    def _take(self, c: _Completion, index: int) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=self.request_id, index=index,
                                       token_ids=c.ids, text="".join(c.text), logprobs=c.logprobs)
        if self.prompt_logprobs is not None and not c.prompt_sent:
            response.prompt_logprobs.extend(self.prompt_logprobs)
            c.prompt_sent = True
        c.ids, c.text, c.logprobs = [], [], []
        return response

    def _finish(self, c: _Completion, index: int, reason: str,
                stop: str | int | None) -> list[pb.GenerateResponse]:
        c.finished, c.finish_time = True, time.monotonic()
        c.reason = reason
        finished = pb.Finished(reason=finish_reason_to_proto(reason),
                               prompt_tokens=self.num_prompt_tokens,
                               completion_tokens=c.out.num_tokens,
                               cached_prompt_tokens=self.num_cached_tokens)
        if isinstance(stop, str):
            finished.stop_string = stop
        elif stop is not None:
            finished.stop_token_id = stop
        response = self._take(c, index)
        response.finished.CopyFrom(finished)
        return [response]


def _logprobs(lp: SampleLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(logprob=lp.logprob, top_token_ids=lp.top_token_ids,
                            top_logprobs=lp.top_logprobs, rank=lp.rank)
