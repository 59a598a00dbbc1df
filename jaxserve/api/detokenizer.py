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
  an extension of the previous one (possible with normalizing decoders); the
  stream is then re-primed from the recent output tokens and the token retried.

For byte-level BPE tokenizers (the demo model, GPT-2, Llama 3) the deltas
concatenate to exactly ``tokenizer.decode(output_ids)``; for tokenizers whose
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
        self._stream = DecodeStream(list(self._context), skip_special_tokens)
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
        delta = self._protected_step(token_id)
        self._output_ids.append(token_id)
        if delta is None:
            self._num_pending += 1
            return ""
        self._num_pending = 0
        self._text_parts.append(delta)
        return delta

    def _protected_step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer, token_id)
        except Exception as err:  # the tokenizers binding raises plain Exception
            if _INVALID_PREFIX not in str(err):
                raise
        # Re-prime a fresh stream with a clean tail of what was already emitted,
        # then step the pending ids (they returned None before) and this one
        # together; if the decoder still disagrees with itself, start without
        # context (the text then continues, possibly without a leading space).
        logger.warning("DecodeStream lost its prefix at token %d; re-priming", token_id)
        done = len(self._output_ids) - self._num_pending
        todo = self._output_ids[done:] + [token_id]
        tail = clean_tail(self._tokenizer, self._context + self._output_ids[:done],
                          skip_special_tokens=self._skip)
        self._stream = DecodeStream(tail, self._skip)
        try:
            return self._stream.step(self._tokenizer, todo)
        except Exception as err:  # as above
            if _INVALID_PREFIX not in str(err):
                raise
        self._stream = DecodeStream(None, self._skip)
        return self._stream.step(self._tokenizer, todo)

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
