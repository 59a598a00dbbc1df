"""The real server refuses bad input, a full queue and late calls, and keeps serving.

One server for the module (worker, engine, api processes; 4 sequences,
64-token steps, the model's 8192-token context) with a
waiting queue of 4 sequences, so at most 8 are in flight.

- 30 bad requests, each answered with its documented status and a message
  naming the field; afterwards the server answers a good request and every
  KV block is free.
- A duplicate running request id (the first request completes intact), an id
  reused right after its request stopped on a stop string, a full queue
  (RESOURCE_EXHAUSTED; HTTP 429) and a passed deadline (DEADLINE_EXCEEDED) — the
  cut requests' blocks come back.
- Health (SERVING for "" and the service, NOT_FOUND for others), server
  reflection listing the services, GetModelInfo / Tokenize against the
  tokenizer, and the Prometheus metrics after traffic.
"""

from __future__ import annotations

import math
import time
from concurrent import futures
import urllib.request

import grpc
import httpx
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
    ProtoReflectionDescriptorDatabase
from google.protobuf.descriptor_pool import DescriptorPool
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from jaxserve.client import Client, JaxServeError
from jaxserve.client.types import build_generate_request
from jaxserve.procutil import free_port
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto import generate_pb2_grpc as pb_grpc
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_IDS
from tests.e2e.helpers import serve, wait_all_blocks_free

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 4
MAX_WAITING = 4
LONG = dict(max_tokens=2000, ignore_eos=True, temperature=0.0)  # runs until cancelled
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def server(demo_model_dir):
    metrics_port = free_port()
    with serve(demo_model_dir, max_waiting_requests=MAX_WAITING,
               metrics_port=metrics_port, http_port=free_port()) as launcher:
        launcher.metrics_port = metrics_port
        yield launcher


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerateServiceStub(channel)


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return AutoTokenizer.from_pretrained(str(demo_model_dir))


def _request(prompt="Hello", messages=None, **params) -> pb.GenerateRequest:
    return build_generate_request(None if messages is not None else prompt, messages=messages,
                                  sampling_params=None, params=params, stream=False)


def _bad_cases(vocab: int, max_len: int):
    """(name, request, status, message prefix) for requests the server must refuse."""
    sp = "sampling_params."
    many_stops = list(range(10, 10 + MAX_STOP_IDS))  # + EOS = one too many
    return [
        ("empty text", _request(""), INVALID, "text:"),
        ("empty token ids", _request([]), INVALID, "token_ids:"),
        ("token id = vocab", _request([1, vocab]), INVALID, "token_ids:"),
        ("negative token id", _request([-1, 5]), INVALID, "token_ids:"),
        ("no prompt", pb.GenerateRequest(), INVALID, "prompt:"),
        ("empty chat", _request(messages=[]), INVALID, "chat.messages:"),
        ("chat without role", _request(messages=[("", "hi")]), INVALID, "chat.messages[0].role:"),
        ("prompt fills the context", _request([5] * max_len), INVALID, "token_ids:"),
        ("prompt + max_tokens too long", _request([5] * 100, max_tokens=max_len - 99), INVALID,
         sp + "max_tokens:"),
        ("temperature < 0", _request(temperature=-0.5), INVALID, sp + "temperature:"),
        ("temperature NaN", _request(temperature=math.nan), INVALID, sp + "temperature:"),
        ("top_p 0", _request(top_p=0.0), INVALID, sp + "top_p:"),
        ("top_p > 1", _request(top_p=1.5), INVALID, sp + "top_p:"),
        ("top_k < -1", _request(top_k=-2), INVALID, sp + "top_k:"),
        ("min_p > 1", _request(min_p=1.5), INVALID, sp + "min_p:"),
        ("n 0", _request(n=0), INVALID, sp + "n:"),
        ("n > max_num_seqs", _request(n=MAX_NUM_SEQS + 1), INVALID, sp + "n:"),
        ("presence_penalty > 2", _request(presence_penalty=2.5), INVALID,
         sp + "presence_penalty:"),
        ("frequency_penalty < -2", _request(frequency_penalty=-3.0), INVALID,
         sp + "frequency_penalty:"),
        ("repetition_penalty 0", _request(repetition_penalty=0.0), INVALID,
         sp + "repetition_penalty:"),
        ("max_tokens 0", _request(max_tokens=0), INVALID, sp + "max_tokens:"),
        ("min_tokens > max_tokens", _request(max_tokens=5, min_tokens=10), INVALID,
         sp + "min_tokens:"),
        ("logprobs > 20", _request(logprobs=21), INVALID, sp + "logprobs:"),
        ("empty stop string", _request(stop=[""]), INVALID, sp + "stop:"),
        ("stop token id = vocab", _request(stop_token_ids=[vocab]), INVALID,
         sp + "stop_token_ids:"),
        ("too many stop ids with EOS", _request(stop_token_ids=many_stops), INVALID,
         sp + "stop_token_ids:"),
        ("logit bias id = vocab", _request(logit_bias={vocab: 1.0}), INVALID, sp + "logit_bias:"),
        ("too many logit biases",
         _request(logit_bias={i: 0.5 for i in range(100, 101 + MAX_LOGIT_BIAS)}), INVALID,
         sp + "logit_bias:"),
        ("prompt_logprobs > 20", _request(prompt_logprobs=21), INVALID, sp + "prompt_logprobs:"),
    ]


def test_bad_inputs_get_their_status_and_field_and_the_server_keeps_serving(
        client, stub, tokenizer):
    info = client.model_info()
    cases = _bad_cases(info.vocab_size, info.max_model_len)
    assert len(cases) >= 20
    failures = []
    for name, request, code, prefix in cases:
        try:
            list(stub.Generate(request, timeout=60))
            failures.append(f"{name}: accepted")
        except grpc.RpcError as err:
            if err.code() != code or not err.details().startswith(prefix):
                failures.append(f"{name}: {err.code().name} {err.details()!r}, want {code.name} "
                                f"{prefix!r}...")
    # Tokenize refuses an empty text too.
    with pytest.raises(JaxServeError) as err:
        client.tokenize("")
    assert err.value.code == INVALID and err.value.message.startswith("text:")
    assert not failures, "\n".join(failures)
    # Still serving: the same stop-token budget minus one id is accepted, and blocks are all free.
    ok = client.generate("The capital of France is", max_tokens=4, temperature=0.0,
                         stop_token_ids=list(range(10, 10 + MAX_STOP_IDS - 1)))
    assert ok.finish_reason in ("stop", "length") and ok.usage.completion_tokens >= 1
    free, total = wait_all_blocks_free(client)
    assert free == total > 0


def _start_long_streams(stub, count: int) -> list:
    return [stub.Generate(build_generate_request(f"Count slowly from {i}:", messages=None,
                                                 sampling_params=None, params=LONG, stream=True))
            for i in range(count)]


def _wait_first_responses(calls: list, count: int, timeout: float = 120.0) -> None:
    """Blocks until ``count`` of the streaming ``calls`` have sent a response."""
    pool = futures.ThreadPoolExecutor(len(calls))
    pending = {pool.submit(next, call) for call in calls}
    deadline = time.monotonic() + timeout
    done: set = set()
    while len(done) < count and time.monotonic() < deadline:
        finished, pending = futures.wait(pending, timeout=1.0,
                                         return_when=futures.FIRST_COMPLETED)
        done |= finished
    pool.shutdown(wait=False)  # the rest end when their calls are cancelled
    assert len(done) >= count, f"only {len(done)} of {len(calls)} streams answered"
    for future in done:
        future.result()


def test_duplicate_running_request_id_is_refused_and_the_first_completes_intact(client):
    params = dict(max_tokens=32, ignore_eos=True, temperature=0.0)
    want = list(client.generate("Tell me a story.", **params).token_ids)
    deltas = client.stream("Tell me a story.", request_id="dup-1", **params)
    first = [next(deltas)]  # running
    with pytest.raises(JaxServeError) as err:
        client.generate("Hi", request_id="dup-1", max_tokens=2)
    assert err.value.code == INVALID
    assert err.value.message.startswith("request_id:") and "dup-1" in err.value.message
    first += list(deltas)
    assert [t for d in first for t in d.token_ids] == want
    assert first[-1].finish_reason == "length" and first[-1].usage.completion_tokens == 32
    assert wait_all_blocks_free(client)[0] == client.model_info().num_kv_blocks_total


def test_request_id_is_reusable_right_after_its_request_stopped_on_a_stop_string(client):
    """A stop string is found in the api: the old request's abort may not have reached the
    engine and its last tokens may still be on the wire when the id comes back (found by
    test_fuzz_server.py: the new request got one of the old one's tokens, or was refused)."""
    prompt, params = "Once upon a time", dict(ignore_eos=True, temperature=0.0)
    text = client.generate(prompt, max_tokens=6, **params).text
    stop = text[len(text) // 2:][:3]  # reached after a few tokens; the request would run on
    for attempt in range(8):
        old = client.generate(prompt, request_id="reused", max_tokens=64, stop=[stop], **params)
        assert old.finish_reason == "stop", (attempt, stop, old.text)
        new = client.generate("Hi", request_id="reused", max_tokens=2, **params)
        assert (len(new.token_ids), new.usage.completion_tokens, new.finish_reason) == (
            2, 2, "length"), attempt
    assert wait_all_blocks_free(client)[0] == client.model_info().num_kv_blocks_total


def _wait_in_flight(port: int, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _scrape(port)["jaxserve_num_sequences_in_flight"][()] == count:
            return
        time.sleep(0.1)
    raise AssertionError(f"never {count} sequences in flight")


def test_full_queue_is_resource_exhausted_and_cancelled_calls_free_blocks(server, client, stub):
    calls = _start_long_streams(stub, MAX_NUM_SEQS + MAX_WAITING)
    try:
        _wait_first_responses(calls, MAX_NUM_SEQS)  # the running ones have produced a token
        _wait_in_flight(server.metrics_port, MAX_NUM_SEQS + MAX_WAITING)  # all admitted
        info = client.model_info()
        assert info.num_kv_blocks_free < info.num_kv_blocks_total
        with pytest.raises(JaxServeError) as err:
            client.generate("One more", max_tokens=2)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in err.value.message
        reply = httpx.post(f"http://127.0.0.1:{server.options.http_port}/v1/completions",
                           json={"prompt": "One more", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 429, reply.text
        assert "queue is full" in reply.json()["error"]["message"]
    finally:
        for call in calls:
            call.cancel()
    free, total = wait_all_blocks_free(client)
    assert free == total
    assert client.generate("Now there is room", max_tokens=2).usage.completion_tokens >= 1


def test_deadline_is_honoured_and_frees_blocks(client):
    start = time.monotonic()
    with pytest.raises(JaxServeError) as err:
        client.generate("Write a very long essay about rivers.", timeout=1.5, **LONG)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 10
    free, total = wait_all_blocks_free(client)
    assert free == total


def test_health_and_reflection(server, client):
    assert client.health() == "SERVING"
    assert client.health("jaxserve.GenerateService") == "SERVING"
    with pytest.raises(JaxServeError) as err:
        client.health("jaxserve.NoSuchService")
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    with grpc.insecure_channel(server.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"jaxserve.GenerateService", "grpc.health.v1.Health"} <= services
        service = DescriptorPool(db).FindServiceByName("jaxserve.GenerateService")
        assert {m.name for m in service.methods} == {"Generate", "GetModelInfo", "Tokenize"}
        assert service.methods_by_name["Generate"].output_type.full_name == \
            "jaxserve.GenerateResponse"


def test_model_info_and_tokenize_agree_with_the_tokenizer(client, tokenizer):
    info = client.model_info()
    assert info.model == "SmolLM2-135M-Instruct"
    assert info.vocab_size == 49152 and info.max_model_len == 8192 and info.block_size == 16
    assert info.eos_token_ids == (tokenizer.eos_token_id,)
    text = "Tokenize me, please: 日本語 and emoji 😀."
    assert list(client.tokenize(text).token_ids) == tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    result = client.tokenize(messages=messages)
    assert result.text == rendered
    assert list(result.token_ids) == tokenizer.encode(rendered, add_special_tokens=False)


def _scrape(port: int) -> dict[str, dict[tuple, float]]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_prometheus_metrics(server, client):
    before = _scrape(server.metrics_port)
    result = client.generate("The three primary colors are", max_tokens=6, temperature=0.0,
                             ignore_eos=True)
    with pytest.raises(JaxServeError):
        client.generate("x", top_p=7.0)
    time.sleep(1.5)  # the engine gauges refresh once a second
    after = _scrape(server.metrics_port)

    def total(metrics, name, labels=()):
        return metrics.get(name, {}).get(tuple(sorted(labels)), 0.0)

    assert total(after, "jaxserve_generation_tokens_total") - total(
        before, "jaxserve_generation_tokens_total") == result.usage.completion_tokens == 6
    for name in ("jaxserve_time_to_first_token_seconds_count",
                 "jaxserve_time_per_output_token_seconds_count",
                 "jaxserve_e2e_request_latency_seconds_count"):
        assert total(after, name) >= total(before, name) + 1, name
    assert total(after, "jaxserve_request_success_total", [("finished_reason", "length")]) >= 1
    assert total(after, "jaxserve_requests_rejected_total", [("code", "INVALID_ARGUMENT")]) >= 1
    replica = [("replica", "0")]  # engine metrics are per data-parallel replica
    assert 0.0 <= total(after, "jaxserve_kv_cache_usage_perc", replica) <= 1.0
    assert 0.0 <= total(after, "jaxserve_prefix_cache_hit_rate", replica) <= 1.0
    for name in ("jaxserve_num_requests_waiting", "jaxserve_num_requests_running"):
        assert tuple(replica) in after[name] and total(after, name, replica) == 0.0
    assert "jaxserve_num_sequences_in_flight" in after
    assert total(after, "jaxserve_num_sequences_in_flight") == 0.0
    assert total(after, "jaxserve_replica_requests_total", replica) >= 1
    # The recompile guard's production metric: exported, and 0 after all this traffic.
    assert "jaxserve_recompiles_after_warmup_total" in after
    assert total(after, "jaxserve_recompiles_after_warmup_total", replica) == 0.0
