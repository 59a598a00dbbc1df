"""The api's checks of request *forms*: text, chat, the wire ``SamplingParams`` (jax-free).

What a request is checked against — the model and the engine's limits — is
``jaxserve.validation`` (``RequestLimits``), shared with ``jaxserve.LLM`` and
the engine; this module only adds what is particular to ``GenerateRequest``:
a text prompt must be non-empty, a chat needs messages with roles, and the
wire ``SamplingParams`` message becomes a validated ``SamplingParams``.
Errors are ``jaxserve.validation.InvalidArgument`` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto.convert import sampling_params_kwargs_from_proto
from jaxserve.sampling_params import SamplingParams
from jaxserve.validation import InvalidArgument, sampling_params_from_kwargs


def sampling_params_from_proto(message: pb.SamplingParams) -> SamplingParams:
    """A validated ``SamplingParams`` from the wire message (absent max_tokens -> None).

    Raises:
      InvalidArgument: as ``jaxserve.validation.sampling_params_from_kwargs``.
    """
    return sampling_params_from_kwargs(sampling_params_kwargs_from_proto(message))


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
