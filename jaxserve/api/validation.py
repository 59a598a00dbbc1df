"""Request validation for the api process: every bad input becomes an ``InvalidArgument``.

``InvalidArgument`` is a ``ValueError`` that carries the offending field's
name (as its path in ``GenerateRequest``: ``text``, ``token_ids``,
``chat.messages``, ``sampling_params.top_p``, ...); ``str(err)`` is
``"<field>: <what is wrong>"`` and is what the server sends back with gRPC
status ``INVALID_ARGUMENT``.

Sampling parameters are validated by ``SamplingParams`` itself, whose
``ValueError`` messages start with the field's name; this module maps them
to the field. What needs the model is checked here: token ids inside the
vocabulary (prompt, ``stop_token_ids``, ``logit_bias``) and the context
length (prompt + ``max_tokens`` <= ``max_model_len``; ``max_tokens=None``
resolves to the room left, as in vLLM).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto.convert import SAMPLING_FIELDS, sampling_params_kwargs_from_proto
from jaxserve.sampling_params import SamplingParams

SAMPLING_PREFIX = "sampling_params."
_LEADING_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)[\s:]*")
_UNKNOWN = "unknown sampling parameter"  # SamplingParams.from_dict: "<key>: unknown ..."


class InvalidArgument(ValueError):
    """A request field is invalid (gRPC ``INVALID_ARGUMENT``).

    Attributes:
      field: the field's path in ``GenerateRequest`` (``"sampling_params.top_p"``).
      reason: what is wrong with it (``"must be in (0, 1], got 1.5"``).
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def sampling_params_from_kwargs(kwargs: Mapping[str, Any]) -> SamplingParams:
    """``SamplingParams(**kwargs)`` with its errors mapped to the field.

    Raises:
      InvalidArgument: field ``sampling_params.<name>`` for an unknown key or
        any value ``SamplingParams`` rejects.
    """
    try:
        return SamplingParams.from_dict(kwargs)
    except (ValueError, TypeError) as err:
        raise _sampling_error(str(err)) from None


def sampling_params_from_proto(message: pb.SamplingParams) -> SamplingParams:
    """A validated ``SamplingParams`` from the wire message (absent max_tokens -> None).

    Raises:
      InvalidArgument: as ``sampling_params_from_kwargs``.
    """
    return sampling_params_from_kwargs(sampling_params_kwargs_from_proto(message))


def _sampling_error(message: str) -> InvalidArgument:
    """Maps a ``SamplingParams`` error message ("top_p must be ...") to its field."""
    match = _LEADING_NAME.match(message)
    if match is not None and (match.group(1) in SAMPLING_FIELDS
                              or message[match.end():].startswith(_UNKNOWN)):
        return InvalidArgument(SAMPLING_PREFIX + match.group(1), message[match.end():])
    return InvalidArgument("sampling_params", message)


def validate_text(text: str, *, field: str = "text") -> None:
    """A text prompt must be non-empty.

    Raises:
      InvalidArgument: ``field``.
    """
    if not text:
        raise InvalidArgument(field, "the prompt must not be empty")


def validate_chat(messages: Sequence[Any], *, field: str = "chat.messages") -> None:
    """A chat needs at least one message, each with a role (anything with ``.role``).

    Raises:
      InvalidArgument: ``field`` or ``field[i].role``.
    """
    if not messages:
        raise InvalidArgument(field, "a chat needs at least one message")
    for i, message in enumerate(messages):
        if not getattr(message, "role", None):
            raise InvalidArgument(f"{field}[{i}].role", "must not be empty")


def check_token_ids(token_ids: Iterable[int], *, vocab_size: int, field: str) -> None:
    """Every id must be in ``[0, vocab_size)``.

    Raises:
      InvalidArgument: ``field``, naming the first bad id and its position.
    """
    for position, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(field, f"token id {token_id} at position {position} is "
                                         f"outside the vocabulary [0, {vocab_size})")


def validate_request(prompt_token_ids: Sequence[int], params: SamplingParams, *,
                     vocab_size: int, max_model_len: int, prompt_field: str = "token_ids",
                     default_max_tokens: int | None = None) -> SamplingParams:
    """Checks a tokenized request against the model; returns params with max_tokens resolved.

    Args:
      prompt_token_ids: the prompt, i32[P] as a sequence of ints.
      params: already-valid sampling parameters.
      vocab_size: V, the model's vocabulary size (tokens).
      max_model_len: most prompt + generated tokens per request.
      prompt_field: the request field the prompt came from (``text``,
        ``token_ids`` or ``chat.messages``), named in prompt errors.
      default_max_tokens: the model's default reply length in tokens (its
        ``generation_config.json`` ``max_new_tokens``), used when
        ``params.max_tokens`` is None; None = no default.

    Returns:
      ``params``, with ``max_tokens=None`` replaced by the room left,
      ``max_model_len - P``, or by ``default_max_tokens`` when that is smaller
      (but never below ``min_tokens``) — vLLM's rule: a default never makes a
      request too long.

    Raises:
      InvalidArgument: an empty prompt or an id outside the vocabulary
        (``prompt_field``); a prompt that leaves no room to generate
        (``prompt_field``); prompt + max_tokens beyond ``max_model_len``
        (``sampling_params.max_tokens``); min_tokens beyond the room left
        (``sampling_params.min_tokens``); stop token ids or logit-bias ids
        outside the vocabulary.
    """
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise InvalidArgument(prompt_field, "the prompt must not be empty")
    check_token_ids(prompt_token_ids, vocab_size=vocab_size, field=prompt_field)
    check_token_ids(params.stop_token_ids, vocab_size=vocab_size,
                    field=SAMPLING_PREFIX + "stop_token_ids")
    if params.logit_bias:
        check_token_ids(sorted(params.logit_bias), vocab_size=vocab_size,
                        field=SAMPLING_PREFIX + "logit_bias")
    room = max_model_len - num_prompt
    if room < 1:
        raise InvalidArgument(prompt_field, f"the prompt is {num_prompt} tokens; the model's "
                                            f"maximum context length is {max_model_len} tokens, "
                                            f"which leaves no room to generate")
    if params.max_tokens is None:
        if params.min_tokens > room:
            raise InvalidArgument(SAMPLING_PREFIX + "min_tokens",
                                  f"min_tokens {params.min_tokens} plus the prompt's {num_prompt} "
                                  f"tokens exceed the model's maximum context length "
                                  f"of {max_model_len} tokens")
        if default_max_tokens is not None:
            room = min(room, max(default_max_tokens, params.min_tokens))
        return dataclasses.replace(params, max_tokens=room)
    if params.max_tokens > room:
        raise InvalidArgument(SAMPLING_PREFIX + "max_tokens",
                              f"the prompt ({num_prompt} tokens) plus max_tokens "
                              f"({params.max_tokens}) is {num_prompt + params.max_tokens} tokens, "
                              f"beyond the model's maximum context length of {max_model_len}")
    return params
