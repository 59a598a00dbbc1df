"""Request bodies of the OpenAI-compatible HTTP API (pydantic; jax-free).

Field names and meanings follow the OpenAI API reference (Completions and
Chat Completions) and vLLM's extensions to it (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``,
``spaces_between_special_tokens``, ``add_generation_prompt``, ``cache_salt``,
``request_id``, ``return_tokens_as_token_ids``, ``structured_outputs``,
``prompt_logprobs``), so
requests written for vLLM's server work unchanged. Structured outputs come
as OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``)
or vLLM's ``structured_outputs`` object (``json``, ``json_object``,
``regex``, ``choice``, ``grammar``), on both endpoints. Chat takes OpenAI's
``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (checked here: strict
types, distinct names, a ``tool_choice`` other than ``"none"`` needs tools
and may only name one of them; what each choice does is
``jaxserve.api.tool_calling``) and messages with ``tool_calls`` /
``tool_call_id``.

A field the request does not set stays ``None`` and takes the server's
default (the model's generation config, else ``SamplingParams``' default).
Unknown fields are refused (400 naming the field), and so are OpenAI fields
this server cannot honour when set to anything but their no-op value
(``UNSUPPORTED_FIELDS``): nothing is silently ignored. Range checks are
``SamplingParams``' own (one validation for every transport).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo,
                      field_validator)

from jaxserve.api.tool_calling import TOOL_NAME_PATTERN, check_tool_choice, check_tools


def _has_lone_surrogate(value: Any) -> bool:
    """True when a string in ``value`` (at any depth) holds a lone UTF-16 surrogate.

    JSON's ``\\ud800`` escape decodes to such a code point, which has no UTF-8
    form: the tokenizer and gRPC could not take the text.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_lone_surrogate(v) for v in value)
    return False


class _Body(BaseModel):
    # strict: "5" is not an integer nor true a number (OpenAI answers 400 too);
    # an integer is still a valid float.
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _utf8(cls, value: Any) -> Any:
        if _has_lone_surrogate(value):
            raise ValueError("holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                             "without its pair), which is not valid Unicode text")
        return value


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage;
    ``continuous_usage_stats`` (vLLM's) puts the usage so far in every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: OpenAI's ``{"name", "description", "schema",
    "strict"}``. ``name`` is optional (vLLM is lenient too); ``strict`` is a
    bool, and the schema is enforced either way."""

    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(alias="schema")  # "schema" shadows BaseModel's
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``json_schema`` goes with ``type: "json_schema"``
    only (checked with the request, naming ``response_format.json_schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Body):
    """The fields both endpoints share (sampling, streaming, vLLM extensions)."""

    model: str | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted, not used (OpenAI: for abuse monitoring)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>"
    prompt_logprobs: int | None = None  # N: each prompt token's logprob and the top N
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``.

    ``prompt``: a string, a list of token ids, or a batch of either (each
    prompt gets ``n`` choices, indexed ``prompt_index * n + j``).
    ``logprobs``: the number of top logprobs per token (0 = only the sampled
    token's). ``echo`` prepends the prompt's text; with ``logprobs`` the
    prompt's tokens come first in the logprobs too (the first one's null), as
    OpenAI's legacy completions.
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    # OpenAI fields accepted only at their no-op value (UNSUPPORTED_FIELDS)
    best_of: int | None = None
    suffix: str | None = None


class ToolCallFunction(_Body):
    """``tool_calls[].function`` of an assistant message: ``arguments`` is JSON text of an
    object (checked where the chat is rendered, ``jaxserve.api.prompts.template_messages``)."""

    name: str = Field(min_length=1)
    arguments: str


class MessageToolCall(_Body):
    """One entry of an assistant message's ``tool_calls`` (as a reply returned it)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    """One chat message; ``content`` is a string or a list of text parts.

    An assistant message may carry the ``tool_calls`` it made (``content``
    then may be null); a ``tool`` message answers the call ``tool_call_id``.
    ``refusal`` (null) is accepted as OpenAI's client echoes it back.
    """

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    refusal: None = None


class FunctionDefinition(_Body):
    """``tools[].function``: a function the model may call.

    ``parameters`` is the JSON schema of its arguments object (left out: no
    arguments, ``{"type": "object", "properties": {}}``); ``strict`` is
    accepted, and constrained calls always follow the schema.
    """

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Body):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name"}}``."""

    type: Literal["function"]
    function: NamedFunction


# A string is one of the modes, an object names a function (errors name the branch taken).
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")]
    | Annotated[NamedToolChoice, Tag("named")],
    Discriminator(lambda v: "named" if isinstance(v, (dict, NamedToolChoice)) else "mode")]


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` is OpenAI's newer name for ``max_tokens`` (set
    at most one). ``logprobs`` (bool) with ``top_logprobs`` (0..20) returns
    per-token logprobs.
    """

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # function calling (see jaxserve.api.tool_calling)
    tools: list[ToolDefinition] | None = Field(default=None, min_length=1)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields accepted only at their no-op value (UNSUPPORTED_FIELDS)
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        check_tools([t.function.name for t in tools or ()])
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_the_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        # "tools" is validated before "tool_choice" (field order); absent if it failed
        if "tools" in info.data:
            check_tool_choice([t.function.name for t in info.data["tools"] or ()],
                              named_choice(choice))
        return choice


def named_choice(choice: "str | NamedToolChoice | None") -> str | dict[str, str] | None:
    """A body's ``tool_choice`` as ``jaxserve.api.tool_calling`` takes it (a named
    function as ``{"name": ...}``)."""
    return {"name": choice.function.name} if isinstance(choice, NamedToolChoice) else choice


# field -> the values that mean "not used" (anything else is refused with a 400)
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,),
}


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's shape): ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


def _models(base: type[BaseModel]) -> Iterator[type[BaseModel]]:
    for model in base.__subclasses__():
        yield model
        yield from _models(model)


# Every field name of every request model, at any depth: a pydantic error location
# part that is not one of these is a union member tag ("list[int]") or a dict key.
FIELD_NAMES: frozenset[str] = frozenset(field.alias or name for model in _models(_Body)
                                        for name, field in model.model_fields.items())
