"""Incremental detokenization of one completion on ``tokenizers.decoders.DecodeStream``.

``DecodeStream`` (the Rust ``tokenizers`` library; what vLLM V1 uses for fast
tokenizers) keeps a short window of recent ids, decodes it after each new id,
and returns the new text, or ``None`` while the window's text ends in an
incomplete multi-byte character (a U+FFFD replacement character). Its deltas
concatenate to the window-by-window decode of the whole sequence.

What this module adds around it:

- **prompt context**: the stream is primed with the prompt's last few tokens
  (the shortest tail of at least ``CONTEXT_TOKENS`` that decodes without
  U+FFFD, at most ``MAX_CONTEXT_TOKENS``), so the first output token is
  decoded as a continuation: a SentencePiece-style ``▁word`` keeps its
  leading space after a prompt instead of having it stripped as the first
  word of a text. No prompt text is ever emitted.
- **flush**: when the completion ends while a character is still incomplete
  (or a skipped special token is pending), ``flush`` emits what a full decode
  yields for the remainder (U+FFFD for bytes that never completed), so the
  deltas concatenate to exactly the full in-context decode.
- **recovery**: ``DecodeStream`` raises "Invalid prefix" when a decode is not
  an extension of the previous one (a decoder that rewrites earlier text, e.g.
  Llama-2's ``ByteFallback`` when a special token interrupts a byte run); the
  stream is then re-primed from the recent output tokens and the token
  retried. Text already streamed is never taken back, so in such a case the
  deltas keep the earlier reading of the rewritten characters.

Cost (demo tokenizer, this CPU): about 5 µs per token, 17 µs to set up.

For byte-level BPE tokenizers (the demo model, GPT-2, Llama 3) the deltas
concatenate to exactly ``tokenizer.decode(output_ids)``, invalid UTF-8 included; for tokenizers whose
decoder strips a leading space they concatenate to the decode of the output
in the prompt's context (``decode(prompt + output)`` minus ``decode(prompt)``).
``spaces_between_special_tokens`` is a slow-tokenizer option (as in vLLM's
fast path) and has no effect here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 4  # prompt tokens primed into the stream, at least (when the prompt has them)
MAX_CONTEXT_TOKENS = 24  # give up on context when no tail this long decodes cleanly
_INVALID_PREFIX = "Invalid prefix"  # DecodeStreamError::InvalidPrefix's message


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The Rust ``tokenizers.Tokenizer`` behind a tokenizer object.

    Accepts a ``tokenizers.Tokenizer`` or a Hugging Face fast tokenizer
    (anything with a ``backend_tokenizer`` attribute).

    Raises:
      TypeError: a slow (pure-Python) tokenizer or any other object.
    """
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend
    raise TypeError(f"need a tokenizers.Tokenizer or a Hugging Face fast tokenizer, "
                    f"got {type(tokenizer).__name__}")


def clean_tail(tokenizer: Tokenizer, token_ids: Sequence[int], *,
               skip_special_tokens: bool) -> list[int]:
    """The ids that prime a stream: ``[]`` or the last k of ``token_ids``, k in [4, 24].

    The shortest tail of at least ``min(CONTEXT_TOKENS, len(token_ids))``
    tokens whose decode has no U+FFFD (a tail must neither start nor end inside
    a character: ``DecodeStream`` only takes a primed window's text as already
    emitted when it ends cleanly); ``[]`` when no tail up to
    ``MAX_CONTEXT_TOKENS`` does.
    """
    n = len(token_ids)
    for k in range(max(1, min(CONTEXT_TOKENS, n)), min(MAX_CONTEXT_TOKENS, n) + 1):
        tail = [int(i) for i in token_ids[n - k:]]
        if REPLACEMENT_CHAR not in tokenizer.decode(tail, skip_special_tokens=skip_special_tokens):
            return tail
    return []


class IncrementalDetokenizer:
    """Turns one completion's token ids into text deltas, one id at a time.

    Args:
      tokenizer: a ``tokenizers.Tokenizer`` or a Hugging Face fast tokenizer.
      prompt_token_ids: the request's prompt (its tail primes the stream).
      skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.

    ``step(id)`` returns the text the id completes ("" while a character is
    incomplete or for a skipped special token); ``flush()`` returns the rest
    at the end. The concatenation of all deltas is ``text``.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = backend_tokenizer(tokenizer)
        self._skip = skip_special_tokens
        self._context = clean_tail(self._tokenizer, prompt_token_ids,
                                   skip_special_tokens=skip_special_tokens)
        self._stream = self._primed_stream(self._context)
        self._output_ids: list[int] = []
        self._num_pending = 0  # ids stepped since the stream last returned text
        self._text_parts: list[str] = []
        self._flushed = False

    @property
    def output_token_ids(self) -> list[int]:
        """The ids stepped so far (a copy)."""
        return list(self._output_ids)

    @property
    def text(self) -> str:
        """The concatenation of every delta returned so far."""
        return "".join(self._text_parts)

    def step(self, token_id: int) -> str:
        """Adds one output token; returns the text it completes (possibly "").

        Raises:
          RuntimeError: after ``flush``.
        """
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.step after flush")
        token_id = int(token_id)
        try:
            delta = self._stream.step(self._tokenizer, token_id)
            text, pending = ("", self._num_pending + 1) if delta is None else (delta, 0)
        except Exception as err:  # the tokenizers binding raises plain Exception
            if _INVALID_PREFIX not in str(err):
                raise
            text, pending = self._recover(token_id)
        self._output_ids.append(token_id)
        self._num_pending = pending
        if text:
            self._text_parts.append(text)
        return text

    def _primed_stream(self, token_ids: Sequence[int]) -> DecodeStream:
        """A new stream that has read ``token_ids`` (their text counts as already emitted).

        Stepping through the ids (rather than ``DecodeStream(ids)``) works
        with every ``tokenizers`` release that has ``DecodeStream``.
        """
        stream = DecodeStream(skip_special_tokens=self._skip)
        for token_id in token_ids:
            stream.step(self._tokenizer, token_id)
        return stream

    def _replay(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """Steps the ids; returns (their text, ids stepped since the last text)."""
        parts, pending = [], 0
        for token_id in token_ids:
            delta = self._stream.step(self._tokenizer, token_id)
            if delta is None:
                pending += 1
            else:
                parts.append(delta)
                pending = 0
        return "".join(parts), pending

    def _recover(self, token_id: int) -> tuple[str, int]:
        """After "Invalid prefix": re-prime, replay the pending ids and this one.

        First with a clean tail of what was already emitted as context; if the
        decoder still disagrees with itself, without context (the text then
        continues, possibly without a leading space or with an earlier
        character's rewrite lost, since streamed text cannot be taken back).
        """
        logger.warning("DecodeStream lost its prefix at token %d; re-priming", token_id)
        done = len(self._output_ids) - self._num_pending
        todo = self._output_ids[done:] + [token_id]
        tail = clean_tail(self._tokenizer, self._context + self._output_ids[:done],
                          skip_special_tokens=self._skip)
        self._stream = self._primed_stream(tail)
        try:
            return self._replay(todo)
        except Exception as err:  # as in step
            if _INVALID_PREFIX not in str(err):
                raise
        self._stream = self._primed_stream([])
        return self._replay(todo)

    def flush(self) -> str:
        """Ends the completion; returns the text still held by the stream ("" usually).

        Non-empty only when the last ids left a character incomplete: the
        remainder of the full in-context decode (ending in U+FFFD for bytes
        that never completed a character). Idempotent: later calls return "".
        """
        if self._flushed:
            return ""
        self._flushed = True
        if self._num_pending == 0:
            return ""
        decode = self._tokenizer.decode
        full = decode(self._context + self._output_ids, skip_special_tokens=self._skip)
        base = decode(self._context, skip_special_tokens=self._skip)
        emitted = self.text
        if full.startswith(base) and full[len(base):].startswith(emitted):
            rest = full[len(base) + len(emitted):]
        else:  # the decodes do not line up (a normalizing decoder): decode the tail alone
            rest = decode(self._output_ids[-self._num_pending:], skip_special_tokens=self._skip)
        if rest:
            self._text_parts.append(rest)
        return rest
