"""Tool-call parsers on realistic model outputs, whole and streamed.

Each parser gets outputs in its model family's format: one call, several,
text around them, malformed JSON (which stays content, verbatim). The
streamed deltas of every output, cut into pieces at every position and
character by character, rebuild exactly what the whole-output parse returns:
the same content and the same calls, each call's header (index, id, name)
before its arguments.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.api.tool_parsers import (PARSERS, HermesToolParser, JsonArrayToolParser,
                                       Llama3JsonToolParser, MistralToolParser,
                                       NamedToolCallStream, ToolCall, ToolCallStream,
                                       call_from_json, tool_parser)

WEATHER = ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ToolCall("get_time", '{"timezone": "Europe/Paris"}')

# (parser, output, expected content, expected calls)
CASES = [
    # Hermes / Qwen 2.5: the call alone, as Qwen writes it (a newline around the JSON).
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                       '"unit": "celsius"}}\n</tool_call>', None, [WEATHER]),
    # text before, two calls, text after
    (HermesToolParser, 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
                       '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
                       '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n'
                       '</tool_call>\nDone.', "Let me check both.\n\nDone.", [WEATHER, TIME]),
    # the output ends inside the last block (EOS before </tool_call>): the JSON is complete
    (HermesToolParser, '<tool_call>\n{"name": "get_time", "arguments": {"timezone": '
                       '"Europe/Paris"}}\n', None, [TIME]),
    # malformed JSON in a block: the block stays content; the good one is a call
    (HermesToolParser, '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'
                       '<tool_call>{"name": "get_time", "arguments": {"timezone": '
                       '"Europe/Paris"}}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>', [TIME]),
    # arguments given as JSON text are kept as sent
    (HermesToolParser, '<tool_call>{"name": "get_time", "arguments": "{\\"timezone\\": '
                       '\\"Europe/Paris\\"}"}</tool_call>', None, [TIME]),
    # not a call (no name), and an unfinished block: content
    (HermesToolParser, '<tool_call>{"arguments": {}}</tool_call> and <tool_call>{"name": "x", ',
     '<tool_call>{"arguments": {}}</tool_call> and <tool_call>{"name": "x", ', []),
    (HermesToolParser, "No tools needed: 2 < 3 and <tool is not a tag.",
     "No tools needed: 2 < 3 and <tool is not a tag.", []),
    # Llama 3.1 JSON: with the python tag, without it, two calls separated by ';'
    (Llama3JsonToolParser, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris",'
                           ' "unit": "celsius"}}', None, [WEATHER]),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                           '"celsius"}}; {"name": "get_time", "parameters": {"timezone": '
                           '"Europe/Paris"}}', None, [WEATHER, TIME]),
    (Llama3JsonToolParser, ' {"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}\n'
                           'That is the call.', "\nThat is the call.", [TIME]),
    (Llama3JsonToolParser, "The weather in Paris is sunny.", "The weather in Paris is sunny.",
     []),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Par',
     '{"name": "get_weather", "parameters": {"city": "Par', []),
    (Llama3JsonToolParser, '{"answer": 42}', '{"answer": 42}', []),
    # Mistral: text, then the marker and an array
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                        '"unit": "celsius"}}, {"name": "get_time", "arguments": {"timezone": '
                        '"Europe/Paris"}}]', None, [WEATHER, TIME]),
    (MistralToolParser, 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": '
                        '"Europe/Paris"}}]', "Sure. ", [TIME]),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_time", "arguments": ',
     '[TOOL_CALLS] [{"name": "get_time", "arguments": ', []),
    (MistralToolParser, "[TOOL is not the marker", "[TOOL is not the marker", []),
    # Mistral v11+: the marker before each call, name[ARGS]{arguments}
    (MistralToolParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                        '[TOOL_CALLS]get_time[ARGS]{"timezone": "Europe/Paris"}',
     None, [WEATHER, TIME]),
    (MistralToolParser, 'Checking. [TOOL_CALLS]get_time[ARGS] {"timezone":"Europe/Paris"} ok',
     "Checking.  ok", [TIME]),
    (MistralToolParser, '[TOOL_CALLS]get_time[ARGS]{"timezone": "Eur',
     '[TOOL_CALLS]get_time[ARGS]{"timezone": "Eur', []),
    (MistralToolParser, "[TOOL_CALLS]get time[ARGS]{}", "[TOOL_CALLS]get time[ARGS]{}", []),
    (MistralToolParser, "[TOOL_CALLS]get_time[ARGS][1]", "[TOOL_CALLS]get_time[ARGS][1]", []),
    # tool_choice="required": the constrained JSON array, and one cut short by max_tokens
    (JsonArrayToolParser, '[{"name":"get_weather","parameters":{"city":"Paris","unit":'
                          '"celsius"}},{"name":"get_time","parameters":{"timezone":'
                          '"Europe/Paris"}}]',
     None, [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'), TIME]),
    (JsonArrayToolParser, '[{"name":"get_time","parameters":{"timezone":"Europe/Paris"}},'
                          '{"name":"get_weath', ',{"name":"get_weath', [TIME]),
]


def _ids(case):
    return f"{case[0].name}-{case[1][:24]}"


@pytest.mark.parametrize("cls,text,content,calls", CASES, ids=[_ids(c) for c in CASES])
def test_whole_output(cls, text, content, calls):
    assert cls().extract(text) == (content, calls)


def _replay(stream, pieces: list[str]) -> tuple[str, list[dict]]:
    """Pushes ``pieces`` then an empty final push; (content, calls) rebuilt from the deltas."""
    content, calls = "", []
    for i, piece in enumerate([*pieces, ""]):
        for delta in stream.push(piece, final=i == len(pieces)):
            assert set(delta) in ({"content"}, {"tool_calls"}), delta
            if "content" in delta:
                assert delta["content"]
                content += delta["content"]
                continue
            (entry,) = delta["tool_calls"]
            if "id" in entry:  # a call's header, then its arguments
                assert entry["index"] == len(calls) and entry["type"] == "function"
                assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", entry["id"])
                calls.append({"name": entry["function"]["name"],
                              "arguments": entry["function"]["arguments"]})
            else:
                assert entry["index"] == len(calls) - 1 and set(entry["function"]) == {
                    "arguments"}
                calls[-1]["arguments"] += entry["function"]["arguments"]
    return content, calls


def _expected(cls, text):
    content, calls = cls().extract(text)
    return content or "", [{"name": c.name, "arguments": c.arguments} for c in calls]


@pytest.mark.parametrize("cls,text", [c[:2] for c in CASES], ids=[_ids(c) for c in CASES])
def test_streamed_deltas_rebuild_the_whole_parse(cls, text):
    expected = _expected(cls, text)
    assert _replay(ToolCallStream(cls()), [text]) == expected
    assert _replay(ToolCallStream(cls()), list(text)) == expected
    for cut in range(1, len(text)):
        assert _replay(ToolCallStream(cls()), [text[:cut], text[cut:]]) == expected, cut


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_streamed_in_random_pieces(case, cuts):
    cls, text = case[:2]
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    assert _replay(ToolCallStream(cls()), pieces) == _expected(cls, text)


def test_text_is_sent_as_it_comes_outside_calls():
    stream = ToolCallStream(HermesToolParser())
    assert stream.push("The answer") == [{"content": "The answer"}]
    assert stream.push(" is <tool") == [{"content": " is "}]  # "<tool" may start a call
    assert stream.push("box>.") == [{"content": "<toolbox>."}]
    assert not stream.called
    stream = ToolCallStream(HermesToolParser())
    assert stream.push("<tool_call>") == [] and stream.push('{"name": "f", "arguments": {}}') == []
    deltas = stream.push("</tool_call>")
    assert [d["tool_calls"][0]["function"] for d in deltas] == [
        {"name": "f", "arguments": ""}, {"arguments": "{}"}]
    assert stream.called


def test_blank_text_between_calls_is_not_content():
    stream = ToolCallStream(HermesToolParser())
    assert stream.push('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n')[-1] == {
        "tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert stream.push("\n", final=True) == []
    # with no call, blank text is the content
    assert ToolCallStream(HermesToolParser()).push("\n", final=True) == [{"content": "\n"}]


@pytest.mark.parametrize("cls,text", [c[:2] for c in CASES if len(c[3]) > 1])
def test_max_calls_drops_later_calls_whole_and_streamed(cls, text):
    """parallel_tool_calls false: the first call only, in deltas as in the whole parse."""
    content, calls = _expected(cls, text)
    for pieces in ([text], list(text)):
        assert _replay(ToolCallStream(cls(), max_calls=1), pieces) == (content, calls[:1])


def test_named_tool_choice_streams_the_arguments_as_they_come():
    stream = NamedToolCallStream("get_weather")
    first = stream.push('{"city"')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}
    assert stream.push(': "Paris"}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "Paris"}'}}]}]
    assert stream.push("", final=True) == [] and stream.text == '{"city": "Paris"}'


@pytest.mark.parametrize("value,call", [
    ({"name": "f", "arguments": {"a": [1, "é"]}}, ToolCall("f", '{"a": [1, "é"]}')),
    ({"name": "f", "parameters": {}}, ToolCall("f", "{}")),
    ({"name": "f"}, ToolCall("f", "{}")),
    ({"name": "f", "arguments": '{"a": 1}'}, ToolCall("f", '{"a": 1}')),
    ({"name": "f", "arguments": "[1]"}, None),
    ({"name": "f", "arguments": "nope"}, None),
    ({"name": "f", "arguments": 3}, None),
    ({"name": "", "arguments": {}}, None),
    ({"name": "f", "arguments": {}, "extra": 1}, None),
    (["f"], None),
])
def test_call_from_json(value, call):
    assert call_from_json(value) == call


def test_the_parsers_by_name():
    assert sorted(PARSERS) == ["hermes", "llama3_json", "mistral"]
    assert isinstance(tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'.*hermes"):
        tool_parser("qwen")


def test_calls_render_as_openai_tool_calls():
    assert WEATHER.to_openai("chatcmpl-tool-1") == {
        "id": "chatcmpl-tool-1", "type": "function",
        "function": {"name": "get_weather", "arguments": WEATHER.arguments}}
    assert json.loads(WEATHER.arguments) == {"city": "Paris", "unit": "celsius"}
