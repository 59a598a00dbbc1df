"""Per-completion output processing: token ids in, text deltas out, stop strings checked.

One ``IncrementalOutput`` per completion (per sample index when n > 1), fed
with the ``new_token_ids`` of each ``EngineCoreOutput``. Used by the api
process (one per streamed completion) and by the offline ``jaxserve.LLM``.

Contract::

    out = IncrementalOutput(tokenizer, prompt_token_ids, sampling_params)
    for engine_output in ...:
        text, stop = out.push(engine_output.new_token_ids,
                              stop_token=engine_output.finish_reason == "stop")
        send(text)                         # may be "" (held back / incomplete)
        if stop is not None:               # a stop string matched:
            abort the request in the engine; finish_reason = "stop"; stop_reason = stop
            break
        if engine_output.finish_reason is not None:
            text, stop = out.flush()       # the rest; stop is set if the flushed text matched
            send(text); break

The concatenation of every returned ``text`` is ``out.text``: never a broken
UTF-8 character (see ``detokenizer``), stop strings cut out (see
``stop_strings``). ``out.token_ids`` are the completion's ids: after a stop
string match, only up to the token that completed it.

Rules, as vLLM's output processor: the token that ended the completion as EOS
or a stop token id (``stop_token=True``) is kept in ``token_ids`` but left out
of the text unless ``include_stop_str_in_output``; stop strings only match
once more than ``min_tokens`` tokens were generated (text from earlier tokens
can still be where a stop string starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from jaxserve.api.detokenizer import IncrementalDetokenizer
from jaxserve.api.stop_strings import StopStringMatcher
from jaxserve.sampling_params import SamplingParams


class OutputDelta(NamedTuple):
    """One step's result: ``text`` to append, and ``stop``, the stop string that matched or None."""

    text: str
    stop: str | None


class IncrementalOutput:
    """Detokenizes one completion incrementally and applies its stop strings.

    Args:
      tokenizer: a ``tokenizers.Tokenizer`` or a Hugging Face fast tokenizer.
      prompt_token_ids: the prompt (primes the detokenizer; never emitted).
      params: the request's ``SamplingParams``; uses ``stop``,
        ``include_stop_str_in_output``, ``skip_special_tokens``, ``min_tokens``.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                             skip_special_tokens=params.skip_special_tokens)
        self._stops = StopStringMatcher(
            params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._token_ids: list[int] = []
        self._finished = False

    @property
    def token_ids(self) -> list[int]:
        """The completion's token ids accepted so far (a copy)."""
        return list(self._token_ids)

    @property
    def num_tokens(self) -> int:
        """``len(token_ids)``."""
        return len(self._token_ids)

    @property
    def text(self) -> str:
        """The concatenation of every delta returned so far."""
        return self._stops.text

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the completion, or None."""
        return self._stops.matched

    @property
    def finished(self) -> bool:
        """True after a stop string matched or ``flush`` was called."""
        return self._finished

    def push(self, new_token_ids: Sequence[int], *, stop_token: bool = False) -> OutputDelta:
        """Adds one engine step's new ids; returns the text to show and the matched stop string.

        Args:
          new_token_ids: ids new since the last push (usually one).
          stop_token: the last id ended the completion as EOS or a stop token id.

        After a stop string matches, the ids after the one that completed it
        are dropped, and later pushes return ``OutputDelta("", None)``.
        """
        if self._finished:
            return OutputDelta("", None)
        parts = []
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            self._token_ids.append(int(token_id))
            if i == last and stop_token and not self._include_stop:
                break
            text = self._detok.step(token_id)
            if not text:
                continue
            released, stop = self._stops.push(text, armed=len(self._token_ids) > self._min_tokens)
            parts.append(released)
            if stop is not None:
                self._finished = True
                return OutputDelta("".join(parts), stop)
        return OutputDelta("".join(parts), None)

    def flush(self) -> OutputDelta:
        """Ends the completion (EOS, stop token, length, abort); returns the rest of the text.

        The detokenizer's pending text (an incomplete character at the end) is
        still checked against the stop strings, so ``stop`` may be set.
        Idempotent: later calls return ``OutputDelta("", None)``.
        """
        if self._finished:
            return OutputDelta("", None)
        self._finished = True
        rest = self._detok.flush()
        released, stop = self._stops.push(rest, armed=len(self._token_ids) > self._min_tokens)
        if stop is not None:
            return OutputDelta(released, stop)
        return OutputDelta(released + self._stops.flush(), None)
