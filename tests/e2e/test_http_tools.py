"""Tool calling through the real server on the demo model, over HTTP and gRPC.

The HTTP API's package server (``tests/e2e/conftest.py``, shared with
``test_http_api``), which runs ``--enable-auto-tool-choice --tool-call-parser
hermes``.

``tool_choice`` required and named return ``tool_calls`` whose arguments validate
against the tool's parameters (``jsonschema``), whole and as streamed
``delta.tool_calls``; the calls and a tool result go back into the chat (HTTP and gRPC
render it alike); ``auto`` without a call (the demo model writes none) returns the text,
and a call it is made to write (by a regex) comes back as ``tool_calls``. Over gRPC
(``Chat.tool_choice_*``) the same forced calls arrive in ``tool_calls`` with finish
reason ``tool_calls``, whole and on the last streamed delta; a choice naming no tool is
INVALID_ARGUMENT naming ``chat.tool_choice_function``.
"""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from jaxserve.client import JaxServeError
from tests.e2e.http_server import CHAT, MODEL, TOOLS

pytestmark = pytest.mark.slow


PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TOOL_CHAT = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def _streamed_calls(stream) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """(content, [(id, name, arguments)], finish reason) rebuilt from a chat stream's deltas."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        (choice,) = chunk.choices
        delta = choice.delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            if part.id is not None:  # the call's header comes first, with an empty arguments
                assert part.index == len(calls) and part.type == "function"
                calls[part.index] = [part.id, part.function.name, part.function.arguments]
            else:
                assert part.function.name is None
                calls[part.index][2] += part.function.arguments
        reason = choice.finish_reason or reason
    return content, [tuple(c) for _, c in sorted(calls.items())], reason


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_follow_the_tools_schemas(oai, tool_choice):
    """tool_choice required / named: structured outputs force calls whose arguments validate
    against the function's parameters; streamed, the same calls arrive as delta.tool_calls."""
    args = dict(model=MODEL, messages=TOOL_CHAT, tools=TOOLS, tool_choice=tool_choice,
                max_tokens=96, temperature=0)
    whole = oai.chat.completions.create(**args)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls
    assert calls
    for call in calls:
        assert re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", call.id) and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_time"]
    content, streamed, reason = _streamed_calls(oai.chat.completions.create(**args, stream=True))
    assert content == "" and reason == "tool_calls"
    assert [(name, arguments) for _, name, arguments in streamed] == [
        (c.function.name, c.function.arguments) for c in calls]  # greedy: the same calls
    assert all(re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", i) for i, _, _ in streamed)


def test_tool_results_go_back_into_the_chat(oai, grpc_client):
    """The assistant's calls (the reply's message, as the client sends it back) and a tool
    message with the result make the next prompt; tool_choice none: a plain reply."""
    first = oai.chat.completions.create(model=MODEL, messages=TOOL_CHAT, tools=TOOLS,
                                        tool_choice="required", max_tokens=96, temperature=0)
    message = first.choices[0].message
    messages = [*TOOL_CHAT, message, *[
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}
        for call in message.tool_calls]]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                        tool_choice="none", max_tokens=16, temperature=0)
    (choice,) = reply.choices
    assert choice.message.content and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens
    # gRPC: the same chat and tools render the same prompt (greedy: the same reply)
    as_dicts = [*TOOL_CHAT, message.model_dump(include={"role", "content", "tool_calls"}),
                *messages[len(TOOL_CHAT) + 1:]]
    via_grpc = grpc_client.chat(as_dicts, tools=TOOLS, tool_choice="none", max_tokens=16,
                                temperature=0)
    assert via_grpc.text == choice.message.content


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_time"}}])
def test_grpc_tool_choice_returns_the_same_calls(oai, grpc_client, tool_choice):
    """gRPC's Chat.tool_choice_*: the calls HTTP returns (greedy: the same), in
    ``tool_calls`` with fresh ids, whole and on the last streamed delta only."""
    args = dict(tools=TOOLS, tool_choice=tool_choice, max_tokens=96, temperature=0)
    http_calls = oai.chat.completions.create(model=MODEL, messages=TOOL_CHAT,
                                             **args).choices[0].message.tool_calls
    whole = grpc_client.chat(TOOL_CHAT, **args)
    assert whole.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [
        (c.function.name, c.function.arguments) for c in http_calls]
    for call in whole.tool_calls:
        assert re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", call.id)
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    *deltas, last = grpc_client.stream(messages=TOOL_CHAT, **args)
    assert not any(d.tool_calls for d in deltas) and last.finish_reason == "tool_calls"
    assert "".join(d.text for d in (*deltas, last)) == whole.text
    assert [(c.name, c.arguments) for c in last.tool_calls] == [
        (c.name, c.arguments) for c in whole.tool_calls]


def test_auto_tool_choice_reads_a_call_the_model_writes(oai, grpc_client):
    """auto (hermes): a reply holding a call — forced here by a regex, as the demo model
    writes none — comes back as tool_calls with finish reason tool_calls, whole and
    streamed, over HTTP and gRPC."""
    want = [("get_time", {"timezone": "UTC"})]
    regex = r'<tool_call>\{"name":"get_time","arguments":\{"timezone":"UTC"\}\}</tool_call>'
    args = dict(model=MODEL, messages=TOOL_CHAT, tools=TOOLS, tool_choice="auto",
                max_tokens=128, temperature=0,
                extra_body={"structured_outputs": {"regex": regex}})
    (choice,) = oai.chat.completions.create(**args).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == want
    content, streamed, reason = _streamed_calls(oai.chat.completions.create(**args, stream=True))
    assert content == "" and reason == "tool_calls"
    assert [(name, json.loads(arguments)) for _, name, arguments in streamed] == want
    via_grpc = grpc_client.chat(TOOL_CHAT, tools=TOOLS, tool_choice="auto", max_tokens=128,
                                temperature=0, structured_outputs={"regex": regex})
    assert via_grpc.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in via_grpc.tool_calls] == want


def test_grpc_tool_choice_naming_no_tool_is_refused(grpc_client):
    with pytest.raises(JaxServeError) as err:
        grpc_client.chat(TOOL_CHAT, tools=TOOLS, tool_choice="get_stock_price", max_tokens=4)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith("chat.tool_choice_function: names the function "
                                        "'get_stock_price'")


def test_auto_tool_choice_without_a_call_is_content(oai):
    """--enable-auto-tool-choice --tool-call-parser hermes: the demo model writes no
    <tool_call>, so the reply is its text, whole and streamed alike."""
    args = dict(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=16, temperature=0)
    whole = oai.chat.completions.create(**args)  # tool_choice left out: auto
    (choice,) = whole.choices
    assert "<tool_call>" not in choice.message.content and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    content, calls, reason = _streamed_calls(oai.chat.completions.create(
        **args, tool_choice="auto", stream=True))
    assert (content, calls, reason) == (choice.message.content, [], choice.finish_reason)
