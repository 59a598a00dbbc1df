"""Tool calls out of generated text, whole or streamed (api process, jax-free).

A *tool parser* reads the text a model writes when it calls functions and
splits it into **segments**: plain text (the reply's ``content``) and
``ToolCall``s. Each model family writes calls its own way; the parsers here
are vLLM's ``--tool-call-parser`` names:

| name | the model writes |
|---|---|
| ``hermes`` | ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text around them (Hermes 2 Pro, Qwen 2.5 / 3) |
| ``llama3_json`` | ``{"name": ..., "parameters": {...}}`` as the whole reply, optionally after ``<|python_tag|>``, several separated by ``;`` (Llama 3.1 / 3.2 JSON tool calling) |
| ``mistral`` | ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` after optional text (Mistral's pre-v11 tokenizers), or ``[TOOL_CALLS]name[ARGS]{...}`` once per call (v11 and later) |

``JsonArrayToolParser`` reads the output of ``tool_choice="required"``: a JSON
array of ``{"name", "parameters"}`` objects, which structured outputs force
(``jaxserve.api.tool_calling``).

One rule for whole and streamed replies: ``ToolParser.scan(text, final)``
returns the segments of the part of ``text`` that is *decided* — text that
may still turn out to be (the start of) a tool call is held back until more
text settles it, or until ``final``. Segments of a longer text extend those
of its prefix (only the last plain-text segment can grow), so
``ToolCallStream`` turns the growing text of one choice into OpenAI's
``delta`` objects by sending what each scan adds, and ``extract`` (the whole
reply) is the final scan. Text that looks like a call but is not valid JSON
of a call (``{"name": <string>, "arguments" | "parameters": <object>}``)
stays content, verbatim.
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import json
import re
import uuid
from typing import Any, ClassVar

_DECODER = json.JSONDecoder()

TOOL_NAME = r"[A-Za-z0-9_-]{1,64}"
"""A function's name: 1-64 of ``A-Z a-z 0-9 _ -`` (OpenAI's rule)."""


def new_tool_call_id() -> str:
    """A fresh tool call id, ``chatcmpl-tool-<32 hex digits>`` (vLLM's form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model made.

    Attributes:
      name: the function's name.
      arguments: its arguments as JSON text (OpenAI's ``function.arguments``).
    """

    name: str
    arguments: str

    def to_openai(self, call_id: str) -> dict[str, Any]:
        """OpenAI's ``message.tool_calls`` entry: ``{"id", "type", "function"}``."""
        return {"id": call_id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


Segment = str | ToolCall


def call_from_json(value: Any) -> ToolCall | None:
    """A ``ToolCall`` from a decoded ``{"name", "arguments" | "parameters"}`` object, else None.

    ``arguments`` may be an object (re-serialized by ``json.dumps``, non-ASCII kept) or JSON
    text of an object (kept as sent); left out it is ``{}``. Anything else
    (no string ``name``, other keys, arguments that are not an object) is not
    a call.
    """
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
            or not value["name"]:
        return None
    keys = set(value) - {"name"}
    if len(keys) > 1 or not keys <= {"arguments", "parameters"}:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(value["name"], arguments) if isinstance(decoded, dict) else None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _held_back(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class ToolParser(abc.ABC):
    """Splits a model's output into text and tool calls (see the module docstring).

    Attributes:
      name: the ``--tool-call-parser`` name.
      needs_special_tokens: the markers are special tokens, so the request
        decodes with ``skip_special_tokens=False`` unless it says otherwise.
    """

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False

    @abc.abstractmethod
    def scan(self, text: str, final: bool) -> list[Segment]:
        """The segments of the decided part of ``text``.

        Args:
          text: the output so far.
          final: the output is complete: nothing is held back.
        """

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output.

        ``content`` is the text outside the calls but for blank text right
        before a call, or None when there are calls and that text is only
        whitespace; with no calls it is ``text``.
        """
        segments = self.scan(text, final=True)
        calls = [s for s in segments if isinstance(s, ToolCall)]
        if not calls:
            return text, []
        content = "".join(s for s, after in zip(segments, [*segments[1:], None])
                          if isinstance(s, str) and (s.strip() or not isinstance(after, ToolCall)))
        return (content if content.strip() else None), calls


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks among text (Hermes, Qwen).

    A last block the output ends inside without ``</tool_call>`` is still a
    call when its JSON is complete.
    """

    name = "hermes"
    needs_special_tokens = True
    START, END = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> list[Segment]:
        out: list[Segment] = []
        pos = 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                tail = text[pos:]
                tail = tail[:len(tail) - (0 if final else _held_back(tail, self.START))]
                if tail:
                    out.append(tail)
                return out
            if start > pos:
                out.append(text[pos:start])
            body_at = start + len(self.START)
            end = text.find(self.END, body_at)
            if end < 0:
                if final:
                    call = self._call(text[body_at:])
                    out.append(call if call is not None else text[start:])
                return out
            call = self._call(text[body_at:end])
            out.append(call if call is not None else text[start:end + len(self.END)])
            pos = end + len(self.END)

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            return call_from_json(json.loads(body))
        except ValueError:
            return None


def _json_calls(text: str, pos: int, final: bool, separator: str,
                end: str | None) -> tuple[list[ToolCall], int, str]:
    """The calls written as JSON objects from ``pos``, ``separator`` between them.

    Returns:
      (calls, where they stop, state): state ``"open"`` when the text may
      still continue the sequence (not ``final``), ``"closed"`` after the
      ``end`` character, ``"stopped"`` at anything else (a value that is not a
      call, a missing separator, the end of a ``final`` text).
    """
    calls: list[ToolCall] = []
    while True:
        at = _skip_space(text, pos)
        if calls and at < len(text) and text[at] == separator:
            at = _skip_space(text, at + 1)
        if at == len(text):
            return calls, (at if final else pos), ("stopped" if final else "open")
        if end is not None and text[at] == end:
            return calls, at + 1, "closed"
        if text[at] != "{" or (calls and at == _skip_space(text, pos)):
            return calls, pos, "stopped"  # not an object, or no separator before it
        try:
            value, stop = _DECODER.raw_decode(text, at)
        except ValueError:
            return calls, pos, ("stopped" if final else "open")
        call = call_from_json(value)
        if call is None:
            return calls, pos, "stopped"
        calls.append(call)
        pos = stop


class Llama3JsonToolParser(ToolParser):
    """A reply that is ``{"name", "parameters"}`` objects (``;``-separated), maybe after
    ``<|python_tag|>`` (Llama 3.x JSON tool calling). A reply that starts any
    other way is all content; what follows the last call is content."""

    name = "llama3_json"
    BOT = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> list[Segment]:
        at = _skip_space(text, 0)
        if text.startswith(self.BOT, at):
            at += len(self.BOT)
        elif not text.startswith("{", at):
            if not final and self.BOT.startswith(text[at:]):
                return []  # nothing but whitespace or the start of the tag yet
            return [text] if text else []
        calls, stop, state = _json_calls(text, at, final, ";", None)
        if not calls:
            return [] if state == "open" else [text]
        return [*calls, text[stop:]] if state != "open" and stop < len(text) else list(calls)


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}`` objects
    (Mistral's tokenizers before v11), or by ``name[ARGS]{arguments}``, the marker
    repeated before each call (v11 and later; mistral-common's format, which vLLM's
    ``mistral`` parser also reads). A name is a ``TOOL_NAME``."""

    name = "mistral"
    needs_special_tokens = True
    MARK = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    _NAME = re.compile(TOOL_NAME)

    def _named_call(self, text: str, at: int, final: bool
                    ) -> tuple[ToolCall | None, int, str]:
        """The v11 call ``name[ARGS]{...}`` at ``at``: (call, its end, state) with
        ``_json_calls``' states ("closed" for a whole call)."""
        name = self._NAME.match(text, at)
        if name is None:
            return None, at, "stopped"
        after = name.end()
        if not text.startswith(self.ARGS, after):
            held = not final and (after == len(text) or self.ARGS.startswith(text[after:]))
            return None, at, ("open" if held else "stopped")
        body = _skip_space(text, after + len(self.ARGS))
        if body == len(text) or text[body] != "{":
            return None, at, ("open" if body == len(text) and not final else "stopped")
        try:
            value, stop = _DECODER.raw_decode(text, body)
        except ValueError:
            return None, at, ("stopped" if final else "open")
        if not isinstance(value, dict):
            return None, at, "stopped"
        return ToolCall(name.group(), json.dumps(value, ensure_ascii=False)), stop, "closed"

    def scan(self, text: str, final: bool) -> list[Segment]:
        out: list[Segment] = []
        pos = 0
        while True:
            mark = text.find(self.MARK, pos)
            if mark < 0:
                tail = text[pos:]
                tail = tail[:len(tail) - (0 if final else _held_back(tail, self.MARK))]
                if tail:
                    out.append(tail)
                return out
            if mark > pos:
                out.append(text[pos:mark])
            at = _skip_space(text, mark + len(self.MARK))
            if at == len(text) and not final:
                return out
            if text.startswith("[", at):
                calls, stop, state = _json_calls(text, at + 1, final, ",", "]")
            else:
                call, stop, state = self._named_call(text, at, final)
                calls = [] if call is None else [call]
            if state == "open":
                return out
            if state == "stopped" or not calls:
                out.append(text[mark:])  # not an array of calls: all content from here
                return out
            out.extend(calls)
            pos = stop


class JsonArrayToolParser(ToolParser):
    """The output of ``tool_choice="required"``: ``[{"name", "parameters"}, ...]``.

    Structured outputs make the output such an array; a reply cut short
    (``max_tokens``) keeps the calls it completed, and the rest is content.
    """

    name = "json_array"

    def scan(self, text: str, final: bool) -> list[Segment]:
        at = _skip_space(text, 0)
        if at == len(text):
            return [text] if final and text else []
        if text[at] != "[":
            return [text]
        calls, stop, state = _json_calls(text, at + 1, final, ",", "]")
        if not calls:
            return [] if state == "open" else [text]
        return [*calls, text[stop:]] if state != "open" and stop < len(text) else list(calls)


PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}
"""The ``--tool-call-parser`` choices."""


def tool_parser(name: str) -> ToolParser:
    """The parser named ``name`` (a ``PARSERS`` key).

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def add_tool_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags for ``tool_choice="auto"``: ``--enable-auto-tool-choice`` and
    ``--tool-call-parser``."""
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto" (the default when a chat request '
                             'has tools): replies are parsed for tool calls with '
                             '--tool-call-parser (default: such requests are refused)')
    parser.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                        help="how the model writes tool calls, for "
                             "--enable-auto-tool-choice: hermes (Hermes, Qwen), "
                             "llama3_json (Llama 3.x), mistral")


def check_tool_arguments(args: argparse.Namespace) -> None:
    """``--enable-auto-tool-choice`` needs ``--tool-call-parser``.

    Raises:
      ValueError: it is missing.
    """
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                         f"({', '.join(sorted(PARSERS))})")


class ToolCallStream:
    """One choice's streamed text as OpenAI chat ``delta``s, tool calls parsed.

    ``push(text, final)`` takes the next text delta and returns the deltas to
    send: ``{"content": str}``, or for a new call first
    ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}``
    and then ``{"tool_calls": [{"index", "function": {"arguments": <JSON text>}}]}``.
    A blank text segment is held until what follows it is known, so the
    content sent is ``extract``'s.

    Args:
      parser: how calls are written.
      max_calls: calls past this many are not sent (``parallel_tool_calls:
        false``); None = all.
    """

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.num_calls = 0
        self._done = 0  # segments sent whole
        self._partial = 0  # characters sent of the segment at self._done (text)
        self._sent_content = False

    @property
    def called(self) -> bool:
        """Whether a tool call has been sent."""
        return self.num_calls > 0

    def push(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """The deltas that ``text`` (appended to the output) settles; see the class docstring."""
        self.text += text
        segments = self.parser.scan(self.text, final)
        deltas: list[dict[str, Any]] = []
        for i in range(self._done, len(segments)):
            segment = segments[i]
            if isinstance(segment, ToolCall):
                deltas += self._call_deltas(segment)
                self._done, self._partial = i + 1, 0
                continue
            last = i + 1 == len(segments)
            if last and not final:  # may grow: send it once it is not blank
                if segment.strip():
                    self._send(segment[self._partial:], deltas)
                    self._partial = len(segment)
                continue
            after = None if last else segments[i + 1]
            # extract's rule: blank text before a call, or after calls and no content, is dropped
            if segment.strip() or not (isinstance(after, ToolCall)
                                       or (last and self.called and not self._sent_content)):
                self._send(segment[self._partial:], deltas)
            self._done, self._partial = i + 1, 0
        return deltas

    def _send(self, text: str, deltas: list[dict[str, Any]]) -> None:
        if text:
            deltas.append({"content": text})
            self._sent_content = True

    def _call_deltas(self, call: ToolCall) -> list[dict[str, Any]]:
        index = self.num_calls
        self.num_calls += 1
        if self.max_calls is not None and index >= self.max_calls:
            return []
        return [{"tool_calls": [{"index": index, "id": new_tool_call_id(), "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


class NamedToolCallStream:
    """The streamed output of a named ``tool_choice``: the text *is* the arguments.

    The first ``push`` sends the call's header (``index`` 0, ``id``, ``name``);
    every text delta after it is an ``arguments`` fragment.

    Args:
      name: the function ``tool_choice`` names.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.text = ""
        self._started = False

    @property
    def called(self) -> bool:
        """Always true: the reply is the call."""
        return True

    def push(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """The deltas for the next text delta (see the class docstring)."""
        self.text += text
        deltas: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            deltas.append({"tool_calls": [{"index": 0, "id": new_tool_call_id(),
                                           "type": "function",
                                           "function": {"name": self.name, "arguments": ""}}]})
        if text:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas
