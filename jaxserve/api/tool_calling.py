"""Function calling: what a chat request's ``tools`` and ``tool_choice`` ask for (jax-free).

``plan_tool_calls`` turns them into a ``ToolCallPlan``, the one place that
decides, for each ``tool_choice`` (vLLM's rules):

| tool_choice | output | the reply |
|---|---|---|
| ``"none"`` (the default without tools) | free | text; the template still gets the tools |
| ``"auto"`` (the default with tools) | free | parsed by the server's ``--tool-call-parser``; needs ``--enable-auto-tool-choice`` |
| ``"required"`` | a JSON array of ``{"name", "parameters"}``, one ``anyOf`` branch per tool, forced by structured outputs | every element a call |
| ``{"type": "function", "function": {"name"}}`` | the function's arguments, forced by its ``parameters`` schema | one call of that function |

The constraints are JSON schemas for the structured-outputs path
(``StructuredOutputsParams(json=...)``, llguidance), nothing else.

Both APIs take the same choices and get the same checks (``check_tools``,
``check_tool_choice``) and plans: the HTTP API from the request body, the gRPC
API from ``Chat.tool_choice_mode`` / ``Chat.tool_choice_function``
(``jaxserve.api.generate_service``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxserve.api.tool_parsers import (TOOL_NAME, JsonArrayToolParser, NamedToolCallStream,
                                       ToolCall, ToolCallStream, ToolParser)

NO_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}
"""The schema of a function declared without ``parameters``."""

AUTO_NEEDS_FLAGS = ('"auto" tool choice (the default when tools are given) requires the server '
                    'to run with --enable-auto-tool-choice and --tool-call-parser; send '
                    'tool_choice "none", "required" or a named function instead')


TOOL_NAME_PATTERN = f"^{TOOL_NAME}$"
"""A whole function name (``tool_parsers.TOOL_NAME``; both APIs check it)."""

TOOL_CHOICE_MODES = ("none", "auto", "required")
"""``tool_choice`` as a string; a function is named as ``{"name": ...}``."""


class ToolChoiceError(ValueError):
    """A ``tool_choice`` this server cannot serve (the message explains; param ``tool_choice``)."""


def check_tool_name(name: str) -> None:
    """Raises ValueError unless ``name`` follows ``TOOL_NAME_PATTERN``."""
    if not re.fullmatch(TOOL_NAME_PATTERN, name):
        raise ValueError(f"a function's name is 1-64 of A-Z a-z 0-9 _ -, got {name!r:.80}")


def check_tools(names: Sequence[str]) -> None:
    """Raises ValueError when two tools share a name (a call could not be told apart)."""
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"two tools are named {name!r}; names must be distinct")


def _choice_text(choice: str | Mapping[str, str]) -> str:
    return (f"tool_choice {choice!r}" if isinstance(choice, str)
            else f"a named tool_choice ({choice['name']!r})")


def check_tool_choice(names: Sequence[str], choice: str | Mapping[str, str] | None) -> None:
    """Checks a ``tool_choice`` against the request's tools.

    Args:
      names: the tools' function names.
      choice: one of ``TOOL_CHOICE_MODES``, ``{"name": <function>}``, or None (left out).

    Raises:
      ToolChoiceError: an unknown mode; a choice other than ``"none"`` without
        tools; a named function that is not one of them.
    """
    if choice is None or choice == "none":
        return
    if isinstance(choice, str) and choice not in TOOL_CHOICE_MODES:
        raise ToolChoiceError(f"must be one of {', '.join(TOOL_CHOICE_MODES)} or a function's "
                              f"name, got {choice!r}")
    if not names:
        raise ToolChoiceError(f"{_choice_text(choice)} needs tools (set tools)")
    if not isinstance(choice, str) and choice["name"] not in names:
        raise ToolChoiceError(f"names the function {choice['name']!r}, which is not one "
                              f"of tools: {', '.join(names)}")


def required_schema(functions: Mapping[str, Mapping[str, Any] | None], *,
                    parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of ``tool_choice="required"``'s output.

    An array (at least one item; at most one without ``parallel``) whose items
    are ``{"name": <one function's name>, "parameters": <its arguments>}``,
    one ``anyOf`` branch per function so the arguments follow the named
    function's schema.

    Args:
      functions: name -> parameters schema (None: ``NO_PARAMETERS``).
    """
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object",
         "properties": {"name": {"type": "string", "enum": [name]},
                        "parameters": dict(parameters or NO_PARAMETERS)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for name, parameters in functions.items()]}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallPlan:
    """How one chat request calls tools.

    Attributes:
      mode: ``"none"``, ``"auto"``, ``"required"`` or ``"named"``.
      schema: the JSON schema the output is constrained to (required, named), else None.
      parser: reads calls out of the output (auto: the server's; required:
        ``JsonArrayToolParser``), else None.
      name: the function a named ``tool_choice`` calls.
      max_calls: 1 for ``parallel_tool_calls: false`` (later calls are dropped,
        as vLLM does), else None.
    """

    mode: str
    schema: dict[str, Any] | None = None
    parser: ToolParser | None = None
    name: str | None = None
    max_calls: int | None = None

    @property
    def parses(self) -> bool:
        """Whether replies are read for tool calls (every mode but ``none``)."""
        return self.mode != "none"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply: ``ToolParser.extract``'s; named: one call."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.parser is None:
            return text, []
        content, calls = self.parser.extract(text)
        return content, calls[:self.max_calls]

    def constrain(self, kwargs: dict[str, Any], *, other_constraint: str | None = None) -> None:
        """Adds the plan's rules to a request's ``SamplingParams`` keyword arguments, in
        place: ``skip_special_tokens`` false unless set, when the parser reads special
        tokens; the plan's schema as ``structured_outputs``.

        Args:
          kwargs: the request's keyword arguments (a None value counts as not set).
          other_constraint: the request field that constrains the output already
            (``response_format``, ``structured_outputs``), or None.

        Raises:
          ToolChoiceError: the plan constrains the output and ``other_constraint`` is set.
        """
        if (self.parser is not None and self.parser.needs_special_tokens
                and kwargs.get("skip_special_tokens") is None):
            kwargs["skip_special_tokens"] = False  # its markers are special tokens
        if self.schema is None:
            return
        if other_constraint is not None:
            choice = _choice_text(self.mode if self.name is None else {"name": self.name})
            raise ToolChoiceError(f"{choice} constrains the output, so it cannot go with "
                                  f"{other_constraint}; set one of them")
        kwargs["structured_outputs"] = {"json": self.schema}

    def stream(self) -> ToolCallStream | NamedToolCallStream | None:
        """A fresh delta builder for one streamed choice, or None (mode ``none``)."""
        if self.mode == "named":
            return NamedToolCallStream(self.name)
        return (ToolCallStream(self.parser, max_calls=self.max_calls)
                if self.parser is not None else None)


NO_TOOLS = ToolCallPlan("none")


def plan_tool_calls(functions: Mapping[str, Mapping[str, Any] | None], tool_choice: Any, *,
                    auto_parser: ToolParser | None, parallel: bool = True) -> ToolCallPlan:
    """The plan of a request's tools and ``tool_choice``.

    Args:
      functions: the request's tools, name -> parameters schema (None when left out).
      tool_choice: ``"none"``, ``"auto"``, ``"required"``, a function's name
        given as ``{"name": ...}``, or None (``"auto"`` with tools, else ``"none"``).
      auto_parser: the server's ``--tool-call-parser`` when
        ``--enable-auto-tool-choice`` is on, else None.
      parallel: ``parallel_tool_calls`` (false: ``required``'s schema allows one
        call; ``auto`` returns the first call only).

    Raises:
      ToolChoiceError: as ``check_tool_choice``; ``auto`` (asked or by default)
        without ``auto_parser``.
    """
    check_tool_choice(list(functions), tool_choice)
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return NO_TOOLS
    if tool_choice == "auto":
        if auto_parser is None:
            raise ToolChoiceError(AUTO_NEEDS_FLAGS)
        return ToolCallPlan("auto", parser=auto_parser, max_calls=None if parallel else 1)
    if tool_choice == "required":
        return ToolCallPlan("required", schema=required_schema(functions, parallel=parallel),
                            parser=JsonArrayToolParser(), max_calls=None if parallel else 1)
    name = tool_choice["name"]
    return ToolCallPlan("named", schema=dict(functions[name] or NO_PARAMETERS), name=name)
