"""jaxserve.client.Client against a real gRPC server with a scripted servicer (loopback).

Tests the client's wire handling: requests it sends (prompt kinds, sampling
parameters with presence, stream flag), streamed deltas, results assembled
from them, errors carried as JaxServeError(code, message), deadlines, stream
cancellation and the health service. The echo "model" is described in
``fake_generate_server``; expected values come from its ``echo_completion``.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

from jaxserve.api.prompts import RequestPreparer
from jaxserve.client import Client, GenerateResult, JaxServeError, StreamDelta, ToolCall, Usage
from jaxserve.client.types import ResultBuilder, build_tokenize_request, delta_from_proto
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto.convert import sampling_params_kwargs_from_proto
from jaxserve.sampling_params import SamplingParams
from tests.api.fake_generate_server import (MODEL_INFO, NOT_SERVING_SERVICE, SERVICE, FakeServer,
                                            echo_completion)


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    yield fake
    fake.stop()


@pytest.fixture
def client(server):
    with Client(server.target, timeout=10) as c:
        yield c


def last_request(server):
    return server.servicer.requests[-1]


def test_stream_yields_deltas_in_order(client, server):
    deltas = list(client.stream("Hello, 世界", request_id="r1", max_tokens=32))
    assert all(isinstance(d, StreamDelta) for d in deltas)
    assert [d.text for d in deltas[:-1]] == list("Hello, 世界")
    assert [d.token_ids for d in deltas[:-1]] == [(ord(c),) for c in "Hello, 世界"]
    assert not any(d.finished for d in deltas[:-1])
    final = deltas[-1]
    assert final.finished and final.text == "" and final.token_ids == ()
    assert (final.finish_reason, final.stop_reason) == ("stop", None)
    assert final.usage == Usage(prompt_tokens=9, completion_tokens=9, cached_prompt_tokens=4)
    assert {d.request_id for d in deltas} == {"r1"}
    request = last_request(server)
    assert request.stream and request.text == "Hello, 世界" and request.request_id == "r1"


def test_generate_returns_finished_result(client, server):
    result = client.generate("abcdef", max_tokens=4, temperature=0)
    assert isinstance(result, GenerateResult)
    assert (result.text, result.finish_reason, result.stop_reason) == ("abcd", "length", None)
    assert result.token_ids == tuple(ord(c) for c in "abcd")
    assert result.usage.completion_tokens == 4
    request = last_request(server)
    assert not request.stream
    # Only the given sampling parameters are present on the wire.
    params = request.sampling_params
    assert params.HasField("temperature") and params.temperature == 0.0
    assert params.HasField("max_tokens") and not params.HasField("top_p")


def test_stop_string_and_stop_token_reported(client):
    result = client.generate("one two three", stop=["two"])
    assert (result.text, result.finish_reason, result.stop_reason) == ("one ", "stop", "two")
    result = client.generate("one two three", stop_token_ids=[ord("w")])
    assert (result.text, result.stop_reason) == ("one tw", ord("w"))


def test_sampling_params_object_arrives_exactly(client, server):
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=-3, max_tokens=None,
                            stop=["x"], logit_bias={3: -1.5}, skip_special_tokens=False)
    client.generate("hi", sampling_params=params)
    preparer = RequestPreparer(None, vocab_size=1000, max_model_len=64, eos_token_ids=(),
                               max_num_seqs=8)
    received = preparer.sampling_params(
        sampling_params_kwargs_from_proto(last_request(server).sampling_params))
    assert received == SamplingParams.from_dict({**params.to_dict(), "seed": -3 % 2**64})
    # Keyword arguments override the object's fields.
    client.generate("hi", sampling_params=params, top_k=7)
    assert last_request(server).sampling_params.top_k == 7


def test_n_completions_and_logprobs(client):
    result = client.generate("abc", n=3, logprobs=2)
    expected = [echo_completion("abc", i, pb.SamplingParams(n=3)) for i in range(3)]
    assert [c.text for c in result.completions] == [e[0] for e in expected] == ["abc", "bca", "cab"]
    assert [c.index for c in result.completions] == [0, 1, 2]
    first = result.completions[1].logprobs
    assert len(first) == 3 and first[0].top_token_ids == (ord("b"), ord("b") + 1)
    assert first[0].top_logprobs == (-0.5, -1.5)
    deltas = list(client.stream("abc", n=2))
    assert {d.index for d in deltas} == {0, 1}
    for index in (0, 1):
        assert "".join(d.text for d in deltas if d.index == index) == ["abc", "bca"][index]


def test_prompt_kinds(client, server):
    assert client.generate([104, 105]).text == "hi"
    assert last_request(server).WhichOneof("prompt") == "token_ids"
    client.generate([])  # an empty id list is still sent as token ids (the server rejects it)
    assert last_request(server).WhichOneof("prompt") == "token_ids"
    messages = [{"role": "system", "content": "Be brief."}, ("user", "Hi")]
    result = client.chat(messages, add_generation_prompt=False)
    assert result.text == "system: Be brief.\nuser: Hi\n"
    chat = last_request(server).chat
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert chat.HasField("add_generation_prompt") and not chat.add_generation_prompt
    assert "".join(d.text for d in client.stream(messages=messages)) == result.text
    with pytest.raises(ValueError, match="exactly one"):
        client.generate("x", messages=messages)
    with pytest.raises(ValueError, match="exactly one"):
        client.generate()
    with pytest.raises(ValueError, match="^temprature"):
        client.generate("x", temprature=1.0)


def test_a_chat_with_tools_and_tool_calls_arrives_whole(client, server):
    """OpenAI-shaped messages (an assistant's tool_calls, a tool's tool_call_id) and tools go
    into the Chat message: arguments and parameters as JSON text."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "get_time"}}]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                    {"id": "c2", "type": "function",
                     "function": {"name": "get_time", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    client.chat(messages, tools=tools)
    chat = last_request(server).chat
    assert [(t.name, t.description, t.parameters and json.loads(t.parameters))
            for t in chat.tools] == [("get_weather", "weather now",
                                      tools[0]["function"]["parameters"]), ("get_time", "", "")]
    assert [(c.id, c.name, json.loads(c.arguments)) for c in chat.messages[1].tool_calls] == [
        ("c1", "get_weather", {"city": "Oslo"}), ("c2", "get_time", {})]
    assert chat.messages[1].content == "" and chat.messages[2].tool_call_id == "c1"
    assert client.tokenize(messages=messages, tools=tools).text.startswith("user: Weather?")
    assert build_tokenize_request(None, messages, None, tools).chat == chat
    assert chat.WhichOneof("tool_choice") is None and not chat.HasField("parallel_tool_calls")


@pytest.mark.parametrize("tool_choice, field, value", [
    ("required", "tool_choice_mode", "required"),
    ("none", "tool_choice_mode", "none"),
    ({"type": "function", "function": {"name": "get_time"}}, "tool_choice_function", "get_time"),
    ("get_time", "tool_choice_function", "get_time"),
])
def test_tool_choice_and_parallel_tool_calls_travel_in_the_chat(client, server, tool_choice,
                                                                  field, value):
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    client.chat([("user", "Time?")], tools=tools, tool_choice=tool_choice,
                parallel_tool_calls=False)
    chat = last_request(server).chat
    assert chat.WhichOneof("tool_choice") == field and getattr(chat, field) == value
    assert chat.HasField("parallel_tool_calls") and not chat.parallel_tool_calls
    with pytest.raises(ValueError, match="need messages"):
        client.generate("x", tool_choice="required")
    client.chat([("user", "Time?")], tools=tools, tool_choice={"name": "get_time"})
    assert last_request(server).chat.tool_choice_function == "get_time"
    for bad in ({"function": {}}, {"type": "function"}, 3):
        with pytest.raises(TypeError, match="tool_choice"):
            client.chat([("user", "Time?")], tools=tools, tool_choice=bad)


def test_tool_calls_in_the_last_response_reach_the_result():
    """The last response's tool_calls become ``Completion.tool_calls`` (and the result's),
    finish reason TOOL_CALLS "tool_calls"; earlier deltas carry none."""
    first = pb.GenerateResponse(request_id="r", index=0, text='[{"name"')
    last = pb.GenerateResponse(request_id="r", index=0, text=': "f"}]', finished=pb.Finished(
        reason=pb.FINISH_REASON_TOOL_CALLS, prompt_tokens=3, completion_tokens=2))
    last.tool_calls.add(id="chatcmpl-tool-1", name="f", arguments="{}")
    builder = ResultBuilder(1)
    for response in (first, last):
        builder.add(delta_from_proto(response))
    result = builder.result()
    assert result.tool_calls == (ToolCall("chatcmpl-tool-1", "f", "{}"),)
    assert result.finish_reason == "tool_calls" and result.text == '[{"name": "f"}]'
    assert delta_from_proto(first).tool_calls == ()


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
                                  "INTERNAL"])
def test_server_errors_carry_code_and_message(client, code):
    message = "sampling_params.top_p: must be in (0, 1], got 1.5"
    for call in (lambda: client.generate(f"!error {code} {message}"),
                 lambda: list(client.stream(f"!error {code} {message}"))):
        with pytest.raises(JaxServeError) as info:
            call()
        assert info.value.code == grpc.StatusCode[code]
        assert info.value.message == message
        assert str(info.value) == f"{code}: {message}"


def test_deadline_exceeded(client, server):
    server.servicer.cancelled.clear()
    start = time.monotonic()
    with pytest.raises(JaxServeError) as info:
        client.generate("!sleep 5", timeout=0.3)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 3
    assert server.servicer.cancelled.wait(5)  # the server saw the call end
    with pytest.raises(JaxServeError) as info:
        list(client.stream("!sleep 5", timeout=0.3))
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.generate("!sleep 0.05", timeout=5).text == "slept"


def test_client_default_timeout(server):
    with Client(server.target, timeout=0.3) as c:
        with pytest.raises(JaxServeError) as info:
            c.generate("!sleep 5")
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert c.generate("!sleep 0.05", timeout=5).text == "slept"  # per-call wins


def test_closing_a_stream_cancels_the_call(client, server):
    server.servicer.cancelled.clear()
    stream = client.stream("!forever")
    first = [next(stream) for _ in range(3)]
    assert [d.text for d in first] == ["x"] * 3
    stream.close()
    assert server.servicer.cancelled.wait(5)


def test_truncated_stream_is_an_error(client):
    with pytest.raises(JaxServeError) as info:
        client.generate("!truncate")
    assert info.value.code == grpc.StatusCode.INTERNAL and "completion 0" in info.value.message


def test_model_info_and_tokenize(client):
    info = client.model_info()
    assert (info.model, info.max_model_len, info.vocab_size, info.block_size) == (
        MODEL_INFO.model, MODEL_INFO.max_model_len, MODEL_INFO.vocab_size, MODEL_INFO.block_size)
    assert (info.num_kv_blocks_free, info.num_kv_blocks_total, info.eos_token_ids) == (7, 9, (0,))
    tokens = client.tokenize("hé")
    assert tokens.token_ids == (104, 233) and tokens.text == "hé"
    chat = client.tokenize(messages=[{"role": "user", "content": "x"}])
    assert chat.text == "user: x\nassistant: "
    with pytest.raises(JaxServeError) as err:
        client.tokenize("")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.message.startswith("text:")


def test_health(client):
    assert client.health() == "SERVING"
    assert client.health(SERVICE) == "SERVING"
    assert client.health(NOT_SERVING_SERVICE) == "NOT_SERVING"
    with pytest.raises(JaxServeError) as info:
        client.health("no.such.Service")
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_unreachable_server():
    with grpc_free_port() as port, Client(f"127.0.0.1:{port}", timeout=1) as c:
        with pytest.raises(JaxServeError) as info:
            c.health()
        assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        with pytest.raises(JaxServeError) as info:
            c.wait_ready(timeout=0.2)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_wait_ready(client):
    client.wait_ready(timeout=5)


def test_wait_ready_waits_for_serving_not_for_the_connection():
    starting = FakeServer(starting=True)
    flip = threading.Timer(0.5, starting.start_serving)
    try:
        with Client(starting.target, timeout=10) as c:
            with pytest.raises(JaxServeError) as info:  # connected, but still starting
                c.generate("hello", max_tokens=2)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            flip.start()
            c.wait_ready(timeout=30)
            assert starting.servicer.serving.is_set()
            assert c.generate("hello", max_tokens=2).text == "he"
    finally:
        flip.cancel()
        starting.stop()


def test_wait_ready_times_out_while_the_server_is_starting():
    starting = FakeServer(starting=True)
    try:
        with Client(starting.target) as c:
            with pytest.raises(JaxServeError) as info:
                c.wait_ready(timeout=0.5)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert "NOT_SERVING" in info.value.message and "jaxserve serve" in info.value.message
    finally:
        starting.stop()


@pytest.mark.parametrize("target, expected", [
    ("localhost", "localhost:50051"), ("10.0.0.7", "10.0.0.7:50051"),
    ("[::1]", "[::1]:50051"), ("host:8000", "host:8000"), ("[::1]:7", "[::1]:7"),
    ("unix:/tmp/sock", "unix:/tmp/sock"), ("dns:///host:9", "dns:///host:9")])
def test_a_bare_host_gets_the_default_port(target, expected):
    with Client(target) as c:
        assert c.target == expected


class grpc_free_port:
    """A loopback port with nothing listening (bound, then released)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        return None
