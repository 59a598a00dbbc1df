"""The HTTP front end before the engine is ready, and its request checks (no server process).

Starlette's test client drives the real FastAPI app: until the api process
attaches its request runner every endpoint answers 503 in OpenAI's error
shape; the API key is checked before anything else (``/health`` open);
bodies that are not JSON, of the wrong type or with unknown fields are 400s
naming the parameter, before any engine is involved. With a runner attached
over a stub engine that only says it is serving (``served``), requests the
api refuses — another model, out-of-range values — are answered without
reaching it.
"""

from __future__ import annotations

import types

import pytest
from fastapi.testclient import TestClient

from jaxserve.api.openai.app import HttpFrontEnd, _param
from jaxserve.api.prompts import RequestPreparer
from jaxserve.api.runner import RequestRunner
from jaxserve.metrics import ServerMetrics

KEY = "k-123"
MODEL = "m"


@pytest.fixture
def client():
    with TestClient(HttpFrontEnd(api_key=KEY).app) as c:
        yield c


@pytest.fixture
def served():
    """A client of a front end whose runner's engine is a stub that is serving (no tokenizer)."""
    front = HttpFrontEnd()
    preparer = RequestPreparer(None, vocab_size=1000, max_model_len=64, eos_token_ids=(),
                               max_num_seqs=8)
    engine = types.SimpleNamespace(serving=True, error=None)
    front.attach(RequestRunner(engine, preparer, model_name=MODEL,
                               metrics=ServerMetrics(lambda: None), max_pending_seqs=8))
    with TestClient(front.app) as c:
        yield c


AUTH = {"Authorization": f"Bearer {KEY}"}


def _error(reply, status):
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == status and error["message"]
    return error


def test_every_endpoint_is_503_until_the_engine_is_ready(client):
    assert "starting" in _error(client.get("/health"), 503)["message"]
    for path in ("/v1/models",):
        _error(client.get(path, headers=AUTH), 503)
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        error = _error(client.post(path, json=body, headers=AUTH), 503)
        assert error["type"] == "service_unavailable_error"


def test_api_key_comes_first_and_health_stays_open(client):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        reply = client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
        assert _error(reply, 401)["type"] == "authentication_error"
        assert reply.headers["WWW-Authenticate"] == "Bearer"
    _error(client.get("/v1/models"), 401)
    _error(client.get("/health"), 503)  # no key needed: the answer is "starting", not 401
    # The scheme is case-insensitive (RFC 7235): past the key check, to "starting".
    _error(client.get("/v1/models/x", headers={"Authorization": f"bearer {KEY}"}), 503)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "foo": 1}, "foo"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),  # strict: OpenAI refuses these too
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),  # a union: its member tags are not in the name
    ({"prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias"),  # a dict key is not a field
])
def test_malformed_bodies_name_the_parameter(client, body, param):
    error = _error(client.post("/v1/completions", json=body, headers=AUTH), 400)
    assert error["param"] == param and error["message"].startswith(param)


@pytest.mark.parametrize("message,param", [
    ({"role": "user", "content": 5}, "messages[0].content"),  # a union nested in a list
    ({"role": "user", "content": [5]}, "messages[0].content"),
    ({"role": "user", "content": "x", "foo": 1}, "messages[0].foo"),  # unknown, nested
    ({"content": "x"}, "messages[0].role"),
])
def test_malformed_chat_messages_name_the_parameter(client, message, param):
    reply = client.post("/v1/chat/completions", json={"messages": [message]}, headers=AUTH)
    error = _error(reply, 400)
    assert error["param"] == param and error["message"].startswith(param)


@pytest.mark.parametrize("path,template,param", [
    ("/v1/completions", '{"prompt": "a%sb"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "%s"]}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": ["%s"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "%s"}]}',
     "messages[0].content"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
     "messages[0].content"),
    ("/tokenize", '{"prompt": "%s"}', "prompt"),
])
@pytest.mark.parametrize("lone", ["\\ud800", "\\udfff"])
def test_lone_surrogates_are_400s_naming_the_field(client, path, template, param, lone):
    """JSON's \\ud800 escape without its pair has no UTF-8 form: refused before any tokenizer."""
    headers = {**AUTH, "Content-Type": "application/json"}
    error = _error(client.post(path, content=(template % lone).encode(), headers=headers), 400)
    assert error["param"] == param and "surrogate" in error["message"]
    # A surrogate pair is one valid character (U+1F600): not refused (503: no engine yet).
    _error(client.post(path, content=(template % "\\ud83d\\ude00").encode(), headers=headers), 503)


def test_body_that_is_not_json(client):
    error = _error(client.post("/v1/completions", content=b"{nope", headers={
        **AUTH, "Content-Type": "application/json"}), 400)
    assert error["param"] is None and "JSON" in error["message"]
    for headers in ({"Content-Type": "text/plain"}, {}):  # a JSON text sent as something else
        error = _error(client.post("/v1/completions", content=b'{"prompt": "x"}',
                                   headers={**AUTH, **headers}), 400)
        assert "Content-Type: application/json" in error["message"]


def test_unknown_path_is_404_in_openai_shape(client):
    assert _error(client.get("/v1/nothing", headers=AUTH), 404)["type"] == "not_found_error"


@pytest.mark.parametrize("loc,param", [
    (("body", "messages", 0, "content"), "messages[0].content"),
    (("body", "prompt", "list[int]", 3), "prompt[3]"),
    (("body", "messages", 0, "content", "list[dict[str,any]]", 0), "messages[0].content[0]"),
    (("body", "stop", "list[str]", 1), "stop[1]"),
    (("body", "logit_bias", "17"), "logit_bias"),
    (("body",), None),
])
def test_param_paths(loc, param):
    assert _param(loc) == param


def test_an_unknown_fields_name_is_kept():
    assert _param(("body", "messages", 2, "colour"), unknown_field=True) == "messages[2].colour"
    assert _param(("body", "messages", 2, "colour")) == "messages[2]"


def test_a_model_by_id(served):
    entry = served.get(f"/v1/models/{MODEL}").json()
    assert entry["id"] == MODEL and entry["object"] == "model"
    for other in ("other", f"{MODEL}/x"):
        error = _error(served.get(f"/v1/models/{other}"), 404)
        assert error["param"] == "model" and other in error["message"]


@pytest.mark.parametrize("endpoint,body,param", [
    ("completions", {"prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "logit_bias": {"5": -101}}, "logit_bias"),
    ("completions", {"prompt": [1, 2], "seed": 2**64}, "seed"),
    ("completions", {"prompt": [1, 2], "stream_options": {"include_usage": True}},
     "stream_options"),  # without stream (OpenAI and vLLM refuse it too)
    ("completions", {"prompt": [1, 2], "seed": -(2**63) - 1}, "seed"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"},
                                       {"role": "narrator", "content": "y"}]}, "messages[1].role"),
])
def test_out_of_range_values_are_400s_naming_the_parameter(served, endpoint, body, param):
    error = _error(served.post(f"/v1/{endpoint}", json=body), 400)
    assert error["param"] == param and error["message"].startswith(param + ": ")


def test_logprobs_of_masked_tokens_are_finite_json():
    """Structured outputs mask tokens to -inf; the API reports them as -9999.0 (vLLM's floor)."""
    import json
    import math

    from jaxserve.api.openai.serving import OpenAIServing
    from jaxserve.proto import generate_pb2 as pb

    serving = OpenAIServing(types.SimpleNamespace(preparer=types.SimpleNamespace(tokenizer=None)))
    response = pb.GenerateResponse(token_ids=[7], logprobs=[pb.TokenLogprobs(
        logprob=-0.5, top_token_ids=[7, 8, 9], top_logprobs=[-0.5, -math.inf, math.nan])])
    chat = serving.chat_logprobs(response, as_ids=True)
    completion = serving.completion_logprobs(response, 0, as_ids=True)
    json.dumps([chat, completion], allow_nan=False)  # raises on -inf / NaN
    assert [e["logprob"] for e in chat["content"][0]["top_logprobs"]] == [-0.5, -9999.0, -9999.0]
    assert completion["top_logprobs"][0] == {"token_id:7": -0.5, "token_id:8": -9999.0,
                                             "token_id:9": -9999.0}


def test_echoed_prompt_logprobs_and_vllm_prompt_logprobs_shapes():
    """Echo: the prompt's tokens first, the first one's logprob and top null, offsets from 0;
    vLLM's ``prompt_logprobs``: null, then {id: {logprob, rank, decoded_token}} (-inf floored)."""
    import json
    import math

    from jaxserve.api.openai.serving import OpenAIServing
    from jaxserve.proto import generate_pb2 as pb

    tokenizer = types.SimpleNamespace(decode=lambda ids: "".join(f"<{i}>" for i in ids))
    serving = OpenAIServing(types.SimpleNamespace(preparer=types.SimpleNamespace(
        tokenizer=tokenizer)))
    response = pb.GenerateResponse(token_ids=[9], prompt_logprobs=[
        pb.TokenLogprobs(logprob=-1.5, rank=3, top_token_ids=[4, 6], top_logprobs=[-0.5, -1.0]),
        pb.TokenLogprobs(logprob=-math.inf, rank=7, top_token_ids=[5, 4],
                         top_logprobs=[-0.25, -2.0])])
    echo = serving.echo_logprobs([2, 3, 5], response, as_ids=False)
    assert echo == {"tokens": ["<2>", "<3>", "<5>"], "token_logprobs": [None, -1.5, -9999.0],
                    "top_logprobs": [None, {"<4>": -0.5, "<6>": -1.0},
                                     {"<5>": -0.25, "<4>": -2.0}],
                    "text_offset": [0, 3, 6]}
    prompt = serving.prompt_logprobs([2, 3, 5], response)
    json.dumps(prompt, allow_nan=False)
    assert prompt[0] is None
    assert prompt[1] == {"4": {"logprob": -0.5, "rank": 1, "decoded_token": "<4>"},
                         "6": {"logprob": -1.0, "rank": 2, "decoded_token": "<6>"},
                         "3": {"logprob": -1.5, "rank": 3, "decoded_token": "<3>"}}
    assert prompt[2]["5"] == {"logprob": -9999.0, "rank": 7, "decoded_token": "<5>"}
    assert list(prompt[2]) == ["5", "4"]  # the prompt token among the top keeps its place


SCHEMA_FORMAT = {"name": "x", "schema": {"type": "object"}}


@pytest.mark.parametrize("response_format,param", [
    ({"type": "json_object", "extra": 1}, "response_format.extra"),
    ({"type": "json_schema", "json_schema": SCHEMA_FORMAT, "schema": {}}, "response_format.schema"),
    ({"type": "json_schema", "json_schema": {**SCHEMA_FORMAT, "extra": 1}},
     "response_format.json_schema.extra"),
    ({"type": "json_schema", "json_schema": {**SCHEMA_FORMAT, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": False}},
     "response_format.json_schema.schema"),
    ({"type": "text", "json_schema": SCHEMA_FORMAT}, "response_format.json_schema"),
    ({"type": "json_object", "json_schema": SCHEMA_FORMAT}, "response_format.json_schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "xml"}, "response_format.type"),
    ({}, "response_format.type"),
])
@pytest.mark.parametrize("endpoint,body", [
    ("completions", {"prompt": [1, 2]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
def test_a_malformed_response_format_is_a_400_naming_the_field(served, endpoint, body,
                                                               response_format, param):
    error = _error(served.post(f"/v1/{endpoint}", json={**body,
                                                        "response_format": response_format}), 400)
    assert error["param"] == param, error


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("extra,param,words", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "'get_time', which is not one of tools: get_weather"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"},
                                          "extra": 1}}, "tool_choice.extra", ""),
    ({"tools": []}, "tools", "at least 1"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools are named 'get_weather'"),
    ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools[0].type", ""),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools[0].function.name", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters", ""),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", ""),
])
def test_malformed_tools_are_400s_naming_the_field(client, extra, param, words):
    reply = client.post("/v1/chat/completions", json={"messages": CHAT, **extra}, headers=AUTH)
    error = _error(reply, 400)
    assert error["param"] == param and error["message"].startswith(param + ": "), error
    assert words in error["message"]


@pytest.mark.parametrize("message,param", [
    ({"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"id": "c1", "type": "call",
                                           "function": {"name": "f", "arguments": "{}"}}]},
     "messages[1].tool_calls[0].type"),
    ({"role": "tool", "content": "sunny", "tool_call_id": 7}, "messages[1].tool_call_id"),
])
def test_malformed_tool_messages_are_400s_naming_the_field(client, message, param):
    reply = client.post("/v1/chat/completions", json={"messages": [*CHAT, message]},
                        headers=AUTH)
    error = _error(reply, 400)
    assert error["param"] == param and error["message"].startswith(param + ": "), error


@pytest.mark.parametrize("arguments", ['{"a": ', "[1]", "7"])
def test_call_arguments_that_are_not_a_json_object_are_400s(served, arguments):
    """Checked where the chat is rendered (before the model's template is needed)."""
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}
    error = _error(served.post("/v1/chat/completions", json={"messages": [*CHAT, message]}), 400)
    param = "messages[1].tool_calls[0].function.arguments"
    assert error["param"] == param and "JSON text of an object" in error["message"], error


@pytest.mark.parametrize("extra", [{"tools": [WEATHER]}, {"tools": [WEATHER],
                                                         "tool_choice": "auto"}])
def test_auto_tool_choice_needs_the_servers_flags(served, extra):
    """As vLLM: tools with tool_choice auto (asked, or the default) need
    --enable-auto-tool-choice and --tool-call-parser."""
    error = _error(served.post("/v1/chat/completions", json={"messages": CHAT, **extra}), 400)
    assert error["param"] == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in error["message"]


@pytest.mark.parametrize("structured", [{"response_format": {"type": "json_object"}},
                                        {"structured_outputs": {"regex": "a+"}}])
def test_a_forced_tool_call_does_not_go_with_structured_outputs(served, structured):
    body = {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required", **structured}
    error = _error(served.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "tool_choice" and "cannot go with" in error["message"]


def test_an_unknown_tool_call_parser_is_refused():
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'"):
        HttpFrontEnd(tool_parser="qwen")
