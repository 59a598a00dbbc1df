"""The api's checks of request *forms*: a text prompt and a chat (jax-free).

What a request is checked against — the model and the engine's limits — is
``jaxserve.validation`` (``RequestLimits``), shared with ``jaxserve.LLM`` and
the engine; this module only adds what is particular to ``GenerateRequest``:
a text prompt must be non-empty and a chat needs messages with roles. The
wire ``SamplingParams`` message becomes a validated ``SamplingParams`` in
``RequestPreparer.sampling_params`` (``jaxserve.api.prompts``), over the
model's defaults. Errors are ``jaxserve.validation.InvalidArgument`` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxserve.validation import InvalidArgument


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
