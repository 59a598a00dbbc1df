"""From a ``GenerateRequest`` to a tokenized, validated request (api process, jax-free).

``RequestPreparer.prepare(request)`` returns the prompt's token ids and the
``SamplingParams`` (``max_tokens`` resolved) or raises ``InvalidArgument``
naming the field, or ``Unsupported`` for a valid parameter this server
cannot honour (gRPC ``UNIMPLEMENTED``); both from ``jaxserve.validation``.

It is built from two steps any front end (gRPC, HTTP) uses the same way:
``sampling_params(kwargs)`` — the request's explicit sampling fields over the
model's defaults (``jaxserve.generation_config``), validated — and
``validate(prompt_token_ids, params)`` — the checks against the model and
the engine's limits (``jaxserve.validation.RequestLimits``, the same code
the engine runs), ``max_tokens`` resolved.

A chat's ``tool_choice`` becomes a ``ToolCallPlan`` (``chat_tool_plan``,
``jaxserve.api.tool_calling``): its schema constrains the output and
``PreparedRequest.tools`` reads calls out of the replies.

Prompts are tokenized exactly as ``jaxserve.LLM`` does: text with
``tokenizer.encode(text)`` (the tokenizer's own special-token rule), a chat
rendered by the tokenizer's chat template and encoded without adding special
tokens again.
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Mapping, Sequence
from typing import Any

from jaxserve.api.tool_calling import (NO_TOOLS, ToolCallPlan, ToolChoiceError,
                                       check_tool_name, check_tools, plan_tool_calls)
from jaxserve.api.tool_parsers import ToolParser
from jaxserve.api.validation import validate_chat, validate_text
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto.convert import sampling_params_kwargs_from_proto
from jaxserve.sampling_params import SamplingParams
from jaxserve.validation import InvalidArgument, RequestLimits, sampling_params_from_kwargs

_NO_DEFAULTS: Mapping[str, Any] = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A tokenized, validated request.

    Attributes:
      prompt_token_ids: the prompt, i32[P] as ints.
      prompt_field: the request field the prompt came from (gRPC: "text",
        "token_ids", "chat.messages"; HTTP: "prompt", "messages").
      params: validated ``SamplingParams`` with ``max_tokens`` resolved.
      tools: how replies are read for tool calls (a chat's ``tool_choice``).
    """

    prompt_token_ids: list[int]
    prompt_field: str
    params: SamplingParams
    tools: ToolCallPlan = NO_TOOLS


def _json_object(text: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise InvalidArgument(field, f"must be JSON text of an object: {err}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(field, f"must be JSON text of an object, got {text!r:.80}")
    return value


def template_messages(messages: Sequence[Mapping[str, Any]], *, field: str = "messages",
                      arguments_path: str = "function.arguments") -> list[dict[str, Any]]:
    """OpenAI-shaped chat messages as chat templates take them (as vLLM passes them).

    Each message as given, except that the ``arguments`` of an assistant's
    ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
    "arguments"}}]``), JSON text in the API, become objects: templates such
    as Qwen's and Llama's serialize them themselves.

    Args:
      messages: ``{"role", "content", "tool_calls"?, "tool_call_id"?, ...}`` dicts.
      field: the messages' name in errors.
      arguments_path: a call's ``arguments`` below ``tool_calls[j]`` in errors.

    Raises:
      InvalidArgument: ``<field>[i].tool_calls[j].<arguments_path>`` is not JSON
        text of an object.
    """
    out = []
    for i, m in enumerate(messages):
        message = dict(m)
        if m.get("tool_calls"):
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                function = dict(call["function"])
                if isinstance(function.get("arguments"), str):
                    function["arguments"] = _json_object(
                        function["arguments"], f"{field}[{i}].tool_calls[{j}].{arguments_path}")
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out


def _chat_messages(chat: pb.Chat) -> list[dict[str, Any]]:
    """A ``pb.Chat``'s messages in OpenAI's shape (``tool_calls`` / ``tool_call_id`` when set)."""
    out = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in m.tool_calls]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def template_tools(tools: Sequence[pb.Tool], *, field: str = "chat.tools") -> list[dict[str, Any]]:
    """Tools as chat templates take them: ``{"type": "function", "function": {"name",
    "description", "parameters"}}`` (description and parameters only when set).

    Raises:
      InvalidArgument: ``<field>[i].name`` empty or ``<field>[i].parameters`` not
        JSON text of an object.
    """
    out = []
    for i, tool in enumerate(tools):
        try:
            check_tool_name(tool.name)
        except ValueError as err:
            raise InvalidArgument(f"{field}[{i}].name", str(err)) from None
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            function["parameters"] = _json_object(tool.parameters, f"{field}[{i}].parameters")
        out.append({"type": "function", "function": function})
    return out


def chat_tool_plan(chat: pb.Chat, auto_parser: ToolParser | None) -> ToolCallPlan:
    """The ``ToolCallPlan`` of a gRPC chat's ``tools``, ``tool_choice_mode`` /
    ``tool_choice_function`` and ``parallel_tool_calls`` (``plan_tool_calls``).

    Args:
      auto_parser: the server's ``--tool-call-parser`` when
        ``--enable-auto-tool-choice`` is on, else None.

    Raises:
      InvalidArgument: ``chat.tools`` (two with one name, parameters that are not
        a JSON object) or ``chat.tool_choice_mode`` / ``chat.tool_choice_function``
        (``check_tool_choice``; ``auto`` without ``auto_parser``).
    """
    functions = {t["function"]["name"]: t["function"].get("parameters")
                 for t in template_tools(chat.tools)}
    try:
        check_tools([t.name for t in chat.tools])
    except ValueError as err:
        raise InvalidArgument("chat.tools", str(err)) from None
    kind = chat.WhichOneof("tool_choice")
    choice = (None if kind is None else chat.tool_choice_mode if kind == "tool_choice_mode"
              else {"name": chat.tool_choice_function})
    try:
        return plan_tool_calls(functions, choice, auto_parser=auto_parser,
                               parallel=not chat.HasField("parallel_tool_calls")
                               or chat.parallel_tool_calls)
    except ToolChoiceError as err:
        raise InvalidArgument(f"chat.{kind or 'tool_choice_mode'}", str(err)) from None


class RequestPreparer:
    """Tokenizes and validates requests for one model.

    Args:
      tokenizer: the model's Hugging Face (fast) tokenizer.
      vocab_size: V, tokens.
      max_model_len: most prompt + generated tokens.
      eos_token_ids: the model's EOS ids (count against ``MAX_STOP_IDS``).
      max_num_seqs: the engine's row count (the most completions per request).
      (these four make ``limits``, the ``RequestLimits`` every request is checked against)
      defaults: the model's default sampling parameters
        (``jaxserve.generation_config.load_sampling_defaults``: ``SamplingParams``
        keyword arguments; ``max_tokens`` is a default reply length that
        ``validate`` caps at the room the prompt leaves).

    Raises:
      InvalidArgument: ``defaults`` has an unknown key or a value
        ``SamplingParams`` rejects (``sampling_params.<name>``).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int,
                 eos_token_ids: Sequence[int], max_num_seqs: int,
                 defaults: Mapping[str, Any] = _NO_DEFAULTS) -> None:
        self.tokenizer = tokenizer
        self.limits = RequestLimits(vocab_size=vocab_size, max_model_len=max_model_len,
                                    max_num_seqs=max_num_seqs, eos_token_ids=tuple(eos_token_ids))
        sampling_params_from_kwargs(defaults)  # fail at start-up, not on every request
        defaults = dict(defaults)
        self.default_max_tokens: int | None = defaults.pop("max_tokens", None)
        self.defaults: Mapping[str, Any] = types.MappingProxyType(defaults)

    # -------------------------------------------------------------- prompts
    def encode_text(self, text: str) -> list[int]:
        """The ids of a text prompt (as ``jaxserve.LLM``)."""
        # verbose=False: transformers' warning for ids longer than the tokenizer's
        # model_max_length ("... will result in indexing errors") is not ours to
        # give: ``validate`` refuses a prompt the engine cannot hold, with its field.
        return list(self.tokenizer.encode(text, verbose=False))

    def render_chat(self, chat: pb.Chat, *, field: str = "chat.messages",
                    tools_field: str = "chat.tools", arguments_path: str = "arguments") -> str:
        """The chat rendered by the tokenizer's chat template, its tools passed as ``tools``.

        Messages and tools reach the template as ``template_messages`` and
        ``template_tools`` make them; ``field``, ``tools_field`` and
        ``arguments_path`` (a call's arguments below ``<field>[i].tool_calls[j]``)
        name them in errors.

        Raises:
          InvalidArgument: no messages, a message without a role, a model
            without a chat template, arguments or parameters that are not JSON
            objects, or a chat the template refuses (its error message).
        """
        validate_chat(chat.messages, field=field)
        messages = template_messages(_chat_messages(chat), field=field,
                                     arguments_path=arguments_path)
        tools = template_tools(chat.tools, field=tools_field) or None
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgument(field, "this model has no chat template (its "
                                         "tokenizer_config.json sets none); send a text prompt "
                                         "instead (completions)")
        add_generation_prompt = (chat.add_generation_prompt
                                 if chat.HasField("add_generation_prompt") else True)
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt)
        except Exception as err:  # noqa: BLE001 - a template's own error (jinja raise_exception)
            raise InvalidArgument(field, f"the chat template refused the chat: {err}") from None

    def encode_chat(self, chat: pb.Chat, *, field: str = "chat.messages",
                    tools_field: str = "chat.tools",
                    arguments_path: str = "arguments") -> tuple[str, list[int]]:
        """(rendered text, ids) of a chat; ids encoded without adding special tokens again.

        ``field``, ``tools_field``, ``arguments_path``: names in errors (``render_chat``)."""
        text = self.render_chat(chat, field=field, tools_field=tools_field,
                                arguments_path=arguments_path)
        return text, list(self.tokenizer.encode(text, add_special_tokens=False,
                                                verbose=False))  # as in encode_text

    # -------------------------------------------------------------- requests
    def sampling_params(self, kwargs: Mapping[str, Any]) -> SamplingParams:
        """A request's validated ``SamplingParams``: its explicit values over the model's defaults.

        Args:
          kwargs: the request's ``SamplingParams`` keyword arguments; a key
            whose value is None counts as not set (its default applies).

        Returns:
          ``SamplingParams`` with ``max_tokens`` None (not ``SamplingParams``'
          16) when the request did not set it: ``validate`` resolves it
          against the prompt and the model's default.

        Raises:
          InvalidArgument: ``sampling_params.<name>`` for an unknown key or a
            value ``SamplingParams`` rejects.
        """
        merged: dict[str, Any] = {"max_tokens": None, **self.defaults}
        merged.update((k, v) for k, v in kwargs.items() if v is not None)
        return sampling_params_from_kwargs(merged)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                 prompt_field: str = "token_ids") -> SamplingParams:
        """Checks a tokenized request against the server and the model.

        Args:
          prompt_token_ids: the prompt, i32[P] as ints.
          params: from ``sampling_params``.
          prompt_field: the request field named in prompt errors.

        Returns:
          ``params`` with ``max_tokens`` resolved: the request's, else the
          model's default capped at the room left, else the room left
          (``RequestLimits.resolve_max_tokens``).

        Raises:
          InvalidArgument / Unsupported: as ``RequestLimits.validate``.
        """
        return self.limits.validate(prompt_token_ids, params, prompt_field=prompt_field,
                                    default_max_tokens=self.default_max_tokens)

    def prepare(self, request: pb.GenerateRequest, *,
                tool_parser: ToolParser | None = None) -> PreparedRequest:
        """Tokenizes and validates ``request`` (``sampling_params``, then ``validate``);
        a chat's tool plan (``chat_tool_plan``) constrains its sampling parameters.

        Args:
          tool_parser: reads ``tool_choice`` ``auto`` replies (the server's
            ``--tool-call-parser``), or None: ``auto`` is refused.

        Raises:
          InvalidArgument: a bad prompt, sampling parameter or tool choice (the field is named).
        """
        kwargs = sampling_params_kwargs_from_proto(request.sampling_params)
        kind = request.WhichOneof("prompt")
        tools = NO_TOOLS
        if kind == "chat":
            tools = chat_tool_plan(request.chat, tool_parser)
            try:
                tools.constrain(kwargs, other_constraint=(
                    "sampling_params.structured_outputs"
                    if request.sampling_params.HasField("structured_outputs") else None))
            except ToolChoiceError as err:
                raise InvalidArgument(f"chat.{request.chat.WhichOneof('tool_choice')}",
                                      str(err)) from None
        params = self.sampling_params(kwargs)
        if kind == "text":
            validate_text(request.text)
            ids, field = self.encode_text(request.text), "text"
        elif kind == "token_ids":
            ids, field = list(request.token_ids.ids), "token_ids"
        elif kind == "chat":
            _, ids = self.encode_chat(request.chat)
            field = "chat.messages"
        else:
            raise InvalidArgument("prompt", "set one of text, token_ids or chat")
        return dataclasses.replace(self.prepare_tokens(ids, params, prompt_field=field),
                                   tools=tools)

    def prepare_tokens(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                       prompt_field: str) -> PreparedRequest:
        """A ``PreparedRequest`` from a tokenized prompt and ``sampling_params``' result.

        The HTTP API's path into the same checks as ``prepare`` (``validate``).

        Args:
          prompt_token_ids: the prompt, i32[P] as ints.
          params: from ``sampling_params``.
          prompt_field: the request field the prompt came from, named in errors.

        Raises:
          InvalidArgument / Unsupported: naming the field.
        """
        ids = list(prompt_token_ids)
        return PreparedRequest(ids, prompt_field, self.validate(ids, params,
                                                                prompt_field=prompt_field))
