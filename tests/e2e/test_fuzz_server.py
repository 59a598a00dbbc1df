"""Fuzzing the live server: random requests end in a valid stream or an allowed status.

One server for the module (worker, engine, api processes on
``small_model_dir``, a random-weight Llama with the demo model's tokenizer and
49,152-token vocabulary; ``SMALL_ENGINE``: 4 rows, 64-token steps, the model's
8192-token context; the HTTP API on too). Hypothesis, derandomized (the same examples on every
run, no example database), sends:

- 240 ``GenerateRequest`` messages over gRPC (a third "wild", the rest in
  range): every field absent, in range or out of range (NaN, infinities, huge and negative numbers, int32 and
  uint64 extremes), any unicode in strings, each prompt kind (text, token
  ids inside and outside the vocabulary, chat, none, empty), ``n`` beyond
  ``max_num_seqs``, up to 70 stop ids and logit-bias entries, streamed or
  not, and cancelled after a random number of responses; plus raw bytes
  that are no valid message or hold invalid UTF-8 in a string field;
- 60 random JSON bodies (half in range, half with any JSON value in any
  field) and 10 that are no JSON object to ``/v1/completions`` and
  ``/v1/chat/completions``.

Every gRPC call must end with a complete stream (each of the ``n``
completions' last response carries ``finished``, token ids in the
vocabulary, no more than ``max_tokens``) or with INVALID_ARGUMENT,
UNIMPLEMENTED or RESOURCE_EXHAUSTED (CANCELLED only for our own cancels);
every HTTP call with 200 or a 4xx whose body has the OpenAI error shape
``{"error": {"message", "type", "param", "code"}}`` — never a 5xx. Then the
server still answers a good request and every KV block is free.

Completions are kept short (``max_tokens`` <= 4 when valid, or the call is
cancelled), so the module runs in a few minutes on a CPU.
"""

from __future__ import annotations

import math

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jaxserve.client import Client
from jaxserve.procutil import free_port
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto import generate_pb2_grpc as pb_grpc
from tests.e2e.helpers import SMALL_ENGINE, serve, wait_all_blocks_free

pytestmark = pytest.mark.slow

VOCAB = 49152  # the demo tokenizer's (asserted against GetModelInfo)
MAX_NUM_SEQS = 4  # SMALL_ENGINE
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
INT32 = st.integers(-2**31, 2**31 - 1)
FUZZ = settings(max_examples=240, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(small_model_dir):
    with serve(small_model_dir, SMALL_ENGINE, http_port=free_port()) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120) as c:
        assert c.model_info().vocab_size == VOCAB
        yield c


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


# ------------------------------------------------------------------ strategies
def _floats(lo: float, hi: float, wild: bool) -> st.SearchStrategy[float]:
    """In [lo, hi]; ``wild``: sometimes anything a double holds (NaN, infinities, huge)."""
    if not wild:
        return st.floats(lo, hi)
    return st.one_of(st.floats(lo, hi), st.floats(allow_nan=True),
                     st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300, 5e-324]))


def _ints(lo: int, hi: int, wild: bool) -> st.SearchStrategy[int]:
    """In [lo, hi]; ``wild``: sometimes any int32."""
    return st.one_of(st.integers(lo, hi), INT32) if wild else st.integers(lo, hi)


def _token_ids(max_size: int, wild: bool) -> st.SearchStrategy[list[int]]:
    valid = st.integers(0, VOCAB - 1)
    ids = st.one_of(valid, valid, st.sampled_from([VOCAB, -1]), INT32) if wild else valid
    return st.lists(ids, max_size=max_size)


_TEXT = st.text(max_size=24)  # any unicode scalar value (no surrogates: proto strings are UTF-8)


@st.composite
def sampling_params(draw, *, wild: bool, cancel: bool) -> pb.SamplingParams:
    """Every field absent or drawn (``wild``: also out of range).

    ``max_tokens`` is at most 4 when valid, unless the call is cancelled.
    """
    fields = {
        "n": _ints(1, MAX_NUM_SEQS + (2 if wild else 0), wild),
        "presence_penalty": _floats(-2, 2, wild), "frequency_penalty": _floats(-2, 2, wild),
        "repetition_penalty": _floats(0.5, 2, wild), "temperature": _floats(0, 2, wild),
        "top_p": _floats(0.01 if not wild else 0, 1, wild), "top_k": _ints(-1, 100, wild),
        "min_p": _floats(0, 1, wild), "seed": st.integers(0, 2**64 - 1),
        "ignore_eos": st.booleans(), "min_tokens": _ints(0, 4 if wild else 1, wild),
        "logprobs": _ints(0, 21 if wild else 20, wild),
        "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
        "spaces_between_special_tokens": st.booleans(),
    }
    message = pb.SamplingParams()
    for name, strategy in fields.items():
        if draw(st.booleans()):
            setattr(message, name, draw(strategy))
    if draw(st.integers(0, 9)) == 0:  # computed in the prefill steps
        message.prompt_logprobs = draw(_ints(0, 20, wild))
    small = st.integers(1, 4)
    if cancel:
        max_tokens = draw(st.one_of(st.none(), INT32))
    elif wild:  # small, or out of range: a valid 1000 would run for minutes on a CPU
        max_tokens = draw(st.one_of(small, st.sampled_from([0, -1, 8193, 2**31 - 1]),
                                    INT32.filter(lambda v: v < 1 or v > 8192)))
    else:
        max_tokens = draw(st.one_of(small, st.integers(2, 4)))
    if max_tokens is not None:
        message.max_tokens = max_tokens
    message.stop.extend(draw(st.lists(_TEXT.filter(bool) if not wild else _TEXT, max_size=4)))
    message.stop_token_ids.extend(draw(st.one_of(_token_ids(4, wild), _token_ids(20, wild))
                                       if wild else _token_ids(4, wild)))
    keys = st.one_of(st.integers(0, VOCAB - 1), INT32) if wild else st.integers(0, VOCAB - 1)
    bias = draw(st.dictionaries(keys, _floats(-100, 100, wild), max_size=70 if wild else 8))
    for token, value in bias.items():
        message.logit_bias[token] = value
    return message


@st.composite
def generate_requests(draw) -> tuple[pb.GenerateRequest, int | None]:
    """(request, number of responses after which to cancel it, or None).

    A third of the requests are ``wild`` (any field may be out of range, any
    prompt kind including none and empty); the rest stay in range, so they run.
    """
    wild = draw(st.integers(0, 2)) == 0
    cancel = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 3)))
    request = pb.GenerateRequest(  # a cancelled call streams: its first response comes soon
        request_id=draw(st.one_of(st.just(""), _TEXT)),
        stream=cancel is not None or draw(st.booleans()),
        cache_salt=draw(st.one_of(st.just(""), _TEXT)),
        sampling_params=draw(sampling_params(wild=wild, cancel=cancel is not None)))
    kind = draw(st.sampled_from(["text", "token_ids", "chat"] + (["none"] if wild else [])))
    if kind == "text":
        request.text = draw(st.text(min_size=0 if wild else 1, max_size=60))
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(_token_ids(30, wild).filter(lambda ids: wild or ids)))
        request.token_ids.SetInParent()
    elif kind == "chat":
        roles = st.sampled_from(["user", "assistant", "system"])
        roles = st.one_of(roles, _TEXT) if wild else roles
        for role, content in draw(st.lists(st.tuples(roles, _TEXT), min_size=0 if wild else 1,
                                           max_size=3)):
            request.chat.messages.add(role=role, content=content)
        request.chat.SetInParent()
        if draw(st.booleans()):
            request.chat.add_generation_prompt = draw(st.booleans())
    return request, cancel


# ------------------------------------------------------------------- checks
def _check_stream(request: pb.GenerateRequest, responses: list[pb.GenerateResponse]) -> None:
    """A finished call: each completion ends with exactly one ``finished`` response."""
    sp = request.sampling_params
    n = sp.n if sp.HasField("n") else 1
    finished: dict[int, pb.Finished] = {}
    counts: dict[int, int] = {}
    for r in responses:
        assert 0 <= r.index < n and r.index not in finished, (r.index, n)
        assert all(0 <= t < VOCAB for t in r.token_ids)
        counts[r.index] = counts.get(r.index, 0) + len(r.token_ids)
        if r.HasField("finished"):
            finished[r.index] = r.finished
    assert sorted(finished) == list(range(n)), (sorted(finished), n)
    for index, fin in finished.items():
        assert fin.reason != pb.FINISH_REASON_UNSPECIFIED
        assert fin.completion_tokens == counts.get(index, 0) or fin.reason == pb.FINISH_REASON_STOP
        if sp.HasField("max_tokens"):
            assert fin.completion_tokens <= sp.max_tokens


def _call(channel: grpc.Channel, request: pb.GenerateRequest, cancel: int | None) -> str:
    """Sends ``request``; returns how it ended ("ok", "cancelled" or a status name)."""
    call = pb_grpc.GenerateServiceStub(channel).Generate(request, timeout=120)
    responses = []
    try:
        for response in call:
            responses.append(response)
            if cancel is not None and len(responses) >= cancel:
                call.cancel()
    except grpc.RpcError as err:
        code = call.code()
        if cancel is not None and code == grpc.StatusCode.CANCELLED:
            return "cancelled"
        assert code in ALLOWED, (code, err.details(), request)
        assert err.details(), code
        return code.name
    if cancel is not None and len(responses) >= cancel:  # cancelled after the last response
        return "cancelled"
    _check_stream(request, responses)
    return "ok"


def test_random_generate_requests(channel, client):
    outcomes: dict[str, int] = {}

    @FUZZ
    @given(generate_requests())
    def run(example):
        request, cancel = example
        outcome = _call(channel, request, cancel)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    run()
    assert sum(outcomes.values()) >= 200, outcomes
    # The run reached both sides: streams that finished and each refusal kind.
    assert outcomes.get("ok", 0) >= 20 and outcomes.get("INVALID_ARGUMENT", 0) >= 20, outcomes
    _still_serving(client)


@pytest.mark.parametrize("wire", [
    b"\x12\x02\xff\xfe",  # text = invalid UTF-8
    b"\x0a\x03\xc3\x28\x41" + b"\x12\x02hi",  # request_id = invalid UTF-8
    b"\x1a\x05\x08\x01\x08\xff",  # token_ids cut inside a varint
    b"\xff\xff\xff\xff",  # no message at all
    b"\x2a\x04\x52\x02\x80\x80",  # sampling_params.stop = invalid UTF-8
], ids=["text", "request_id", "truncated", "garbage", "stop"])
def test_undecodable_requests_are_invalid_argument(channel, client, wire):
    generate = channel.unary_stream("/jaxserve.GenerateService/Generate",
                                    request_serializer=lambda raw: raw,
                                    response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        list(generate(wire, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    _still_serving(client)


def _still_serving(client: Client) -> None:
    assert client.health() == "SERVING"
    ok = client.generate("The capital of France is", max_tokens=2, temperature=0.0)
    assert ok.usage.completion_tokens >= 1
    free, total = wait_all_blocks_free(client)
    assert free == total > 0


# ----------------------------------------------------------------------- HTTP
_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                               st.floats(allow_nan=False, allow_infinity=False), _TEXT),
                     lambda inner: st.one_of(st.lists(inner, max_size=3),
                                             st.dictionaries(_TEXT, inner, max_size=3)),
                     max_leaves=6)
_HTTP_FIELDS = {
    "model": st.one_of(st.just("SmolLM2-135M-Instruct"), _JSON),
    "n": st.one_of(st.integers(1, MAX_NUM_SEQS), _JSON),
    "temperature": st.one_of(st.floats(0, 2), _JSON), "top_p": st.one_of(st.floats(0, 1), _JSON),
    "top_k": _JSON, "min_p": _JSON, "seed": st.one_of(st.integers(-2**70, 2**70), _JSON),
    "stop": st.one_of(_TEXT, st.lists(_TEXT, max_size=3), _JSON),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, VOCAB + 5), max_size=20), _JSON),
    "logit_bias": st.one_of(st.dictionaries(st.integers(-5, VOCAB + 5).map(str),
                                            st.floats(-200, 200), max_size=70), _JSON),
    "presence_penalty": _JSON, "frequency_penalty": _JSON, "repetition_penalty": _JSON,
    "min_tokens": _JSON, "ignore_eos": _JSON, "stream": st.one_of(st.booleans(), _JSON),
    "stream_options": _JSON, "logprobs": _JSON, "echo": _JSON, "user": _JSON,
    "request_id": _JSON, "cache_salt": _JSON, "best_of": _JSON, "suffix": _JSON,
    "top_logprobs": _JSON, "response_format": _JSON, "tools": _JSON,
    "return_tokens_as_token_ids": _JSON, "add_generation_prompt": _JSON,
}
_SMALL_MAX = st.one_of(st.integers(1, 4), st.integers(1, 4), st.integers(-3, 0),
                       st.sampled_from([8193, 2**31, 2**70, "4", 1.5, None]))
# In-range values for a body that should run (max_tokens <= 4 keeps it short).
_VALID_HTTP = {
    "n": st.integers(1, MAX_NUM_SEQS), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 2**31 - 1),
    "seed": st.integers(-2**63, 2**64 - 1),
    "stop": st.lists(_TEXT.filter(bool), max_size=3), "stream": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100),
                                  max_size=8),
    "presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "min_p": st.floats(0, 1), "ignore_eos": st.booleans(), "cache_salt": _TEXT,
}


@st.composite
def http_bodies(draw) -> tuple[str, object]:
    """(path, JSON body): half in range (they run), half with any JSON in any field."""
    chat, wild = draw(st.booleans()), draw(st.booleans())
    body: dict[str, object] = {}
    max_tokens = _SMALL_MAX if wild else st.integers(1, 4)
    if chat:
        message = st.fixed_dictionaries({"role": st.one_of(st.just("user"), _TEXT),
                                         "content": st.one_of(_TEXT, _JSON)})
        body["messages"] = draw(st.one_of(st.lists(message, max_size=3), _JSON) if wild else
                                st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                                "content": _TEXT}),
                                         min_size=1, max_size=2))
        body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = draw(max_tokens)
    else:
        body["prompt"] = draw(st.one_of(_TEXT, st.lists(st.integers(-3, VOCAB + 3), max_size=12),
                                        st.lists(_TEXT, max_size=3), _JSON) if wild else
                              st.one_of(_TEXT.filter(bool),
                                        st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                 max_size=12)))
        body["max_tokens"] = draw(max_tokens)
    fields = _HTTP_FIELDS if wild else _VALID_HTTP
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        body[name] = draw(fields[name])
    if wild and draw(st.integers(0, 3)) == 0:
        body[draw(_TEXT)] = draw(_JSON)  # an unknown field, most likely
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _check_http(reply: httpx.Response) -> None:
    assert reply.status_code == 200 or 400 <= reply.status_code < 500, (
        reply.status_code, reply.text)
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
        assert error["code"] == reply.status_code


def test_random_http_bodies(server, client):
    base = f"http://127.0.0.1:{server.options.http_port}"
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=base, timeout=120) as http:
        @settings(FUZZ, max_examples=60)
        @given(http_bodies())
        def run(example):
            path, body = example
            reply = http.post(path, json=body)
            _check_http(reply)
            statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1

        run()
        for raw in (b"", b"{", b"[1, 2]", b"\xff\xfe", b'{"prompt": "hi", "max_tokens": 2,}'):
            for path in ("/v1/completions", "/v1/chat/completions"):
                reply = http.post(path, content=raw, headers={"content-type": "application/json"})
                _check_http(reply)
                assert reply.status_code == 400, (raw, reply.status_code)
        # Found by this fuzzing: top_k beyond int32 passed SamplingParams and failed the
        # engine request's conversion (500); now SamplingParams bounds it.
        reply = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                   "top_k": 2**40})
        _check_http(reply)
        assert (reply.status_code, reply.json()["error"]["param"]) == (400, "top_k")
    assert sum(statuses.values()) >= 50, statuses
    assert statuses.get(200, 0) >= 10 and statuses.get(400, 0) >= 10, statuses
    _still_serving(client)
