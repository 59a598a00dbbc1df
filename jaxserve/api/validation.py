"""The api's checks of request *forms*: a text prompt and a chat (jax-free).

What a request is checked against — the model and the engine's limits — is
``jaxserve.validation`` (``RequestLimits``), shared with ``jaxserve.LLM`` and
the engine; this module only adds what is particular to ``GenerateRequest``:
a text prompt must be non-empty and a chat needs messages, each with one of
OpenAI's roles (``CHAT_ROLES``). The
wire ``SamplingParams`` message becomes a validated ``SamplingParams`` in
``RequestPreparer.sampling_params`` (``jaxserve.api.prompts``), over the
model's defaults. Errors are ``jaxserve.validation.InvalidArgument`` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxserve.validation import InvalidArgument

# The message roles of OpenAI's Chat Completions API (and vLLM's server), which chat
# templates are written for; "function" (OpenAI's deprecated tool role) is left out.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def validate_text(text: str, *, field: str = "text") -> None:
    """A text prompt must be non-empty.

    Raises:
      InvalidArgument: ``field``.
    """
    if not text:
        raise InvalidArgument(field, "the prompt must not be empty")


def validate_chat(messages: Sequence[Any], *, field: str = "chat.messages") -> None:
    """A chat needs at least one message, each with a role in ``CHAT_ROLES``.

    Args:
      messages: anything with ``.role`` (``pb.ChatMessage``).
      field: the request's name for the messages, named in errors.

    Raises:
      InvalidArgument: ``field`` (no messages) or ``field[i].role``.
    """
    if not messages:
        raise InvalidArgument(field, "a chat needs at least one message")
    for i, message in enumerate(messages):
        role = getattr(message, "role", None)
        if role not in CHAT_ROLES:
            raise InvalidArgument(f"{field}[{i}].role",
                                  f"must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}")
