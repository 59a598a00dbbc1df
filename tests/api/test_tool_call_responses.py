"""Chat responses with tool calls, from scripted engine responses (no engine, no model).

``OpenAIResult`` renders the responses of a request as the HTTP API sends
them. Here the responses are scripted — the text a Hermes-style model writes
when it calls two tools, in token-sized pieces — so the ``auto`` path that
the demo model never takes is checked end to end: the whole body has
``message.tool_calls`` and finish reason ``tool_calls``; the SSE chunks carry
the text before the calls as ``delta.content``, each call as a header delta
then its arguments, and end with finish reason ``tool_calls`` and
``[DONE]``. A reply cut by ``max_tokens`` keeps ``length``; ``n = 2``
choices are parsed apart.
"""

from __future__ import annotations

import asyncio
import json
import types

from jaxserve.api.openai.responses import OpenAIResult
from jaxserve.api.prompts import PreparedRequest
from jaxserve.api.tool_calling import NO_TOOLS, plan_tool_calls
from jaxserve.api.tool_parsers import HermesToolParser
from jaxserve.proto import generate_pb2 as pb
from jaxserve.sampling_params import SamplingParams

REPLY = ['I will look', ' both up.', '\n<tool', '_call>\n{"name": "get_weather", ',
         '"arguments": {"city": "Paris"}}\n</tool_call>\n', '<tool_call>\n{"name": "get_time"',
         ', "arguments": {"timezone": "CET"}}\n</tool_call>']
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"timezone": "CET"}')]
AUTO = plan_tool_calls({"get_weather": None, "get_time": None}, "auto",
                       auto_parser=HermesToolParser())


class Scripted:
    """A running request whose responses are given: (index, text, finish reason or None)."""

    def __init__(self, script):
        self.script = script

    async def responses(self):
        for index, text, reason in self.script:
            response = pb.GenerateResponse(index=index, text=text, token_ids=[1])
            if reason is not None:
                response.finished.reason = reason
            yield response

    def close(self):
        pass


def _result(script, tools, n=1):
    serving = types.SimpleNamespace(runner=types.SimpleNamespace(model_name="m"))
    prepared = [PreparedRequest([1, 2, 3], "messages", SamplingParams(n=n, max_tokens=64))]
    return OpenAIResult(serving, "chat.completion", "chatcmpl-1", [Scripted(script)], prepared,
                        echo=None, include_usage=False, as_ids=False, tools=tools)


def _script(pieces, reason=pb.FINISH_REASON_STOP, index=0):
    """Streamed: a response per piece, the last one finished."""
    return [(index, p, None) for p in pieces[:-1]] + [(index, pieces[-1], reason)]


def _whole(pieces, reason=pb.FINISH_REASON_STOP, index=0):
    """Not streamed: one response with the whole text."""
    return [(index, "".join(pieces), reason)]


def _events(result) -> list:
    async def collect():
        return [e async for e in result.events()]
    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_a_whole_reply_with_two_calls():
    body = asyncio.run(_result(_whole(REPLY), AUTO).body())
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "I will look both up.\n"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in
            message["tool_calls"]] == CALLS
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-")
               for c in message["tool_calls"])
    assert len({c["id"] for c in message["tool_calls"]}) == 2


def test_a_streamed_reply_with_two_calls():
    chunks = _events(_result(_script(REPLY), AUTO))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert reasons == [None] * (len(chunks) - 1) + ["tool_calls"]
    assert "".join(d.get("content", "") for d in deltas) == "I will look both up.\n"
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    headers = [c for c in calls if "id" in c]
    assert [(h["index"], h["function"]) for h in headers] == [
        (0, {"name": "get_weather", "arguments": ""}), (1, {"name": "get_time", "arguments": ""})]
    for i, (_, arguments) in enumerate(CALLS):
        assert "".join(c["function"]["arguments"] for c in calls if c["index"] == i) == arguments
    # no content is sent once the text may be a call: "<tool" waits for "_call>"
    assert all("<tool" not in d.get("content", "") for d in deltas)


def test_a_reply_cut_by_max_tokens_keeps_length():
    cut = REPLY[:5] + ['<tool_call>\n{"name": "get_time"']
    body = asyncio.run(_result(_whole(cut, pb.FINISH_REASON_LENGTH), AUTO).body())
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert choice["message"]["content"].endswith('<tool_call>\n{"name": "get_time"')


def test_choices_are_parsed_apart_and_plain_text_stays_content():
    whole = _whole(REPLY) + _whole(["No tools: <b>bold</b>"], index=1)
    body = asyncio.run(_result(whole, AUTO, n=2).body())
    first, second = body["choices"]
    assert first["finish_reason"] == "tool_calls" and len(first["message"]["tool_calls"]) == 2
    assert second["finish_reason"] == "stop" and "tool_calls" not in second["message"]
    assert second["message"]["content"] == "No tools: <b>bold</b>"
    script = [(0, REPLY[0], None), (1, "No tools: <b>", None), (0, "".join(REPLY[1:]), None),
              (1, "bold</b>", pb.FINISH_REASON_STOP), (0, "", pb.FINISH_REASON_STOP)]
    chunks = _events(_result(script, AUTO, n=2))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                   if c["choices"][0]["index"] == 1)
    assert text == "No tools: <b>bold</b>"
    assert [c["choices"][0]["finish_reason"] for c in chunks
            if c["choices"][0]["finish_reason"]] == ["stop", "tool_calls"]


def test_without_tools_the_text_is_not_parsed():
    body = asyncio.run(_result(_whole(REPLY), NO_TOOLS).body())
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "".join(REPLY)}
    assert choice["finish_reason"] == "stop"
