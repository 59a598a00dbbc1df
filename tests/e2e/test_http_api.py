"""The OpenAI-compatible HTTP API through the real server on the demo model, TLS and an API key.

One server (``api_server``, tests/e2e/conftest.py, shared with the tool-calling
tests of test_http_tools; the engine configuration of test_server_generate, so
the step executables come from the shared compilation cache), started with
``--api-key`` and a self-signed certificate; clients trust that certificate.
The official ``openai`` client (sync and async) and raw ``httpx`` talk to it.

- Completions and chat completions, streamed and not: greedy streamed deltas
  concatenate to the non-streamed text; the tokens (``return_tokens_as_token_ids``)
  equal the gRPC service's on the same server; ``n = 2`` returns two choices;
  logprobs and usage have the documented shapes. ``echo`` with ``logprobs``
  returns the prompt tokens' logprobs first (the first null), equal to
  transformers' ``log_softmax`` on the same prompt, whole and streamed; vLLM's
  ``prompt_logprobs`` field (completions and chat) and the gRPC service's
  ``prompt_logprobs`` carry the same values. Structured outputs
  (``response_format`` json_schema / json_object, vLLM's ``structured_outputs``
  choice / regex) follow their constraint; the OpenAI client's ``parse`` helper
  gets its pydantic model back.
- Both transports refuse calls without the key (401 / ``UNAUTHENTICATED``);
  health stays open.
- A table of bad requests (a schema or regex that does not compile among
  them): each gets its status and an error body naming the
  parameter; afterwards the server still serves and every KV block is free.
- 64 concurrent streamed requests all finish; 20 clients that disconnect
  mid-stream, and 4 that give up waiting for a whole response, free every block.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re

import grpc
import httpx
import jsonschema
import openai
import pydantic
import pytest

from jaxserve.client import Client, JaxServeError
from tests.e2e.helpers import wait_all_blocks_free
from tests.e2e.http_server import API_KEY, CHAT, ENGINE, MODEL, PROMPT, TOOLS

pytestmark = pytest.mark.slow


def _token_ids(entries) -> list[int]:
    return [int(e.removeprefix("token_id:")) for e in entries]


# ------------------------------------------------------------ the happy path
def test_models_health_tokenize_detokenize(api_server, http):
    assert httpx.get(api_server.base_url + "/health", verify=api_server.tls).status_code == 200
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert http.get(f"/v1/models/{MODEL}").json() == models["data"][0]
    assert http.get("/v1/models/other").status_code == 404
    assert models["data"][0]["max_model_len"] == ENGINE["max_model_len"]
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 3
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > tokens["count"]


def test_no_server_process_loads_torch(api_server):
    # keep_torch_out (jaxserve.procutil): transformers would import torch (~2 s a process)
    # for the tokenizer and the configs, and did (libtorch mapped in the api and worker
    # processes) before the block. torch is installed here (the test extra), so the check
    # means something.
    assert importlib.util.find_spec("torch") is not None
    libraries = {}
    for name, proc in api_server.processes.items():
        with open(f"/proc/{proc.pid}/maps") as maps:
            libraries[name] = {line.split()[-1].rsplit("/", 1)[-1] for line in maps if "/" in line}
    assert {"api", "worker"} <= set(libraries), sorted(libraries)
    torch_libraries = {name: sorted(lib for lib in libs if lib.startswith(("libtorch", "libc10")))
                       for name, libs in libraries.items()}
    assert torch_libraries == {name: [] for name in libraries}


def test_completions_whole_and_streamed_match_grpc(oai, grpc_client):
    whole = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                   logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    (choice,) = whole.choices
    ids = _token_ids(choice.logprobs.tokens)
    assert len(ids) == whole.usage.completion_tokens == 16 and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.top_logprobs) == 16
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    # Greedy: the sampled token is the most likely one.
    assert all(abs(lp - max(top.values())) < 1e-4
               for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs))
    via_grpc = grpc_client.generate(PROMPT, max_tokens=16, temperature=0)
    assert ids == list(via_grpc.token_ids)
    assert choice.text == via_grpc.text
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    running = [c.usage.completion_tokens for c in oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})]
    assert running == sorted(running) and running[-1] == 16  # the usage so far, every chunk
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_whole_streamed_n2_and_logprobs(oai, grpc_client):
    whole = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                        temperature=0, logprobs=True, top_logprobs=3)
    (choice,) = whole.choices
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    content = choice.logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    assert choice.message.content == grpc_client.chat(CHAT, max_tokens=24, temperature=0).text
    stream = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                         temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == choice.message.content
    two = oai.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=8,
                                      temperature=1.0, seed=7, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert 2 <= two.usage.completion_tokens <= 16
    assert all(c.finish_reason in ("length", "stop") for c in two.choices)


def test_completion_batch_prompts_and_echo(oai):
    batch = oai.completions.create(model=MODEL, prompt=[PROMPT, "Once upon a time"],
                                   max_tokens=4, temperature=0, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in batch.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: n equal samples
    assert batch.usage.completion_tokens == 16
    echoed = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    echo=True)
    assert echoed.choices[0].text == PROMPT + by_index[0]


def _hf_prompt_logprobs(model_dir, ids: list[int]):
    """f32[P - 1, V]: transformers' log_softmax predicting prompt tokens 1 .. P - 1."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([ids]), use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1).numpy()


def test_echo_logprobs_and_prompt_logprobs_equal_transformers(oai, http, grpc_client,
                                                              demo_model_dir):
    whole = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                   echo=True, logprobs=2,
                                   extra_body={"return_tokens_as_token_ids": True})
    (choice,) = whole.choices
    lp = choice.logprobs
    num_prompt = whole.usage.prompt_tokens
    ids = _token_ids(lp.tokens)
    assert len(ids) == num_prompt + 4 and choice.text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    want = _hf_prompt_logprobs(demo_model_dir, ids[:num_prompt])  # [P - 1, V]
    for i in range(1, num_prompt):
        row = want[i - 1]
        assert abs(lp.token_logprobs[i] - float(row[ids[i]])) < 2e-3, i
        top = sorted(range(len(row)), key=lambda t: -row[t])[:2]
        assert list(lp.top_logprobs[i]) == [f"token_id:{t}" for t in top], i
    # The generated part is the plain completion's.
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert choice.text == PROMPT + plain.choices[0].text
    # Streamed: the first chunk carries the echo and the prompt's logprobs.
    chunks = [c for c in oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2,
        stream=True, extra_body={"return_tokens_as_token_ids": True}) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    assert max(abs(a - b) for a, b in zip(streamed[1:], lp.token_logprobs[1:])) < 1e-5
    # vLLM's prompt_logprobs: [null, {id: {logprob, rank, decoded_token}}, ...]
    body = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1,
                                              "prompt_logprobs": 3}).json()
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == num_prompt and entries[0] is None
    for i in range(1, num_prompt):
        mine = entries[i][str(ids[i])]
        assert abs(mine["logprob"] - lp.token_logprobs[i]) < 1e-5
        assert mine["rank"] == 1 + int((want[i - 1] > want[i - 1][ids[i]]).sum())
        assert len(entries[i]) in (3, 4)  # the top 3, and the prompt token unless among them
        assert {e["rank"] for e in entries[i].values()} >= {1, 2, 3}
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1,
                                                   "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # N = 0: the token only
    # The gRPC service: the same values in the completion's first response.
    via_grpc = grpc_client.generate(PROMPT, max_tokens=1, temperature=0, prompt_logprobs=1)
    got = via_grpc.completions[0].prompt_logprobs
    assert len(got) == num_prompt - 1
    assert max(abs(g.logprob - e) for g, e in zip(got, lp.token_logprobs[1:])) < 1e-5
    assert [g.top_token_ids[0] for g in got] == [
        int(next(iter(t)).removeprefix("token_id:")) for t in lp.top_logprobs[1:num_prompt]]


def test_structured_outputs_response_format_and_extra_body(oai, grpc_client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "population_millions": {"type": "integer"}},
              "required": ["city", "population_millions"], "additionalProperties": False}
    reply = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=48, temperature=1.0, seed=3, n=2,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema, "strict": True}})
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    anything = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=64,
                                           temperature=0, response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    choices = ["yes", "no"]
    picked = oai.completions.create(model=MODEL, prompt="Is Paris in France? Answer:",
                                    max_tokens=8, temperature=1.0, n=2,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in picked.choices)
    digits = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", digits.choices[0].text)
    via_grpc = grpc_client.generate(PROMPT, max_tokens=8, temperature=0,
                                    structured_outputs={"regex": "[0-9]{4}"})
    assert via_grpc.text == digits.choices[0].text


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    population_millions: int = pydantic.Field(ge=0, le=100)


def test_the_openai_clients_parse_helper_gets_its_pydantic_model(oai):
    """``chat.completions.parse`` / ``beta.chat.completions.parse`` with a pydantic model as
    ``response_format``: the strict schema the client derives is served, the reply parses."""
    for parse in (oai.chat.completions.parse, oai.beta.chat.completions.parse):
        reply = parse(model=MODEL, messages=CHAT, response_format=City, max_tokens=48,
                      temperature=0)
        (choice,) = reply.choices
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City)
        assert choice.message.parsed == City.model_validate_json(choice.message.content)




# ---------------------------------------------------------------- security
def test_api_key_is_required_on_both_transports(api_server, grpc_client):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        reply = httpx.post(api_server.base_url + "/v1/completions", verify=api_server.tls,
                           headers=headers, json={"prompt": "x", "max_tokens": 1})
        assert reply.status_code == 401
        assert reply.json()["error"]["type"] == "authentication_error"
    address = f"localhost:{api_server.options.port}"
    with Client(address, timeout=60, root_certificates=api_server.cert.read_bytes()) as keyless:
        assert keyless.health("jaxserve.GenerateService") == "SERVING"  # health stays open
        with pytest.raises(JaxServeError) as err:
            keyless.generate("x", max_tokens=1)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(address, timeout=60, api_key="wrong",
                root_certificates=api_server.cert.read_bytes()) as wrong:
        with pytest.raises(JaxServeError) as err:
            wrong.generate("x", max_tokens=1)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_client.generate("x", max_tokens=1).usage.completion_tokens == 1


# ------------------------------------------------------------ bad requests
LONG = list(range(10, 10 + ENGINE["max_model_len"] + 8))
BAD_REQUESTS = [
    # (endpoint, body, status, param)
    ("completions", "{not json", 400, None),
    ("completions", {"max_tokens": 4}, 400, "prompt"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 7}, 400, "top_p"),
    ("completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": "x", "foo": 1}, 400, "foo"),
    ("completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": LONG}, 400, "prompt"),
    ("completions", {"prompt": [5, 10 ** 6]}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": "x", "stop_token_ids": [-5]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs"),
    ("completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("completions", {"prompt": "x", "seed": "x"}, 400, "seed"),
    ("completions", {"prompt": "x", "frequency_penalty": 5}, 400, "frequency_penalty"),
    ("completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400,
     "messages[0].content[0]"),
    ("chat/completions", {"messages": CHAT, "tools": []}, 400, "tools"),
    ("chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_wind"}}}, 400, "tool_choice"),
    ("chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "required",
                          "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"}, 400,
     "tools"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema",
     "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    ("completions", {"prompt": "x", "structured_outputs": {"regex": "a(b"}}, 400,
     "structured_outputs.regex"),
    ("completions", {"prompt": "x", "structured_outputs": {"choice": []}}, 400,
     "structured_outputs.choice"),
    ("completions", {"prompt": "x", "structured_outputs": {"regex": "a"}, "ignore_eos": True},
     400, "structured_outputs"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 4, "max_completion_tokens": 4}, 400,
     "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 5000}, 400,
     "max_completion_tokens"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_request_names_the_parameter(http, endpoint, body, status, param):
    if isinstance(body, str):
        reply = http.post(f"/v1/{endpoint}", content=body,
                          headers={"Content-Type": "application/json"})
    else:
        reply = http.post(f"/v1/{endpoint}", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == status
    assert error["message"] and error["type"]
    if param is not None:
        assert error["message"].startswith(param)


def test_still_serving_after_bad_requests_and_no_block_leaked(oai, grpc_client):
    reply = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2
    free, total = wait_all_blocks_free(grpc_client)
    assert free == total


# ------------------------------------------------------------- concurrency
def test_64_concurrent_streams_finish(api_server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=f"{i} plus {i} is",
                                                 max_tokens=8, temperature=0, stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(
                base_url=api_server.base_url + "/v1", api_key=API_KEY, max_retries=0,
                http_client=httpx.AsyncClient(verify=api_server.tls, timeout=300,
                                              limits=httpx.Limits(max_connections=64))) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    assert all(reason in ("length", "stop") and text for text, reason in results)


def test_disconnected_clients_free_their_blocks(api_server, grpc_client):
    async def leave_mid_stream(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"Story number {i}:", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        received = 0
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    json.loads(line.removeprefix("data: "))
                    received += 1
                    if received == 3:
                        break  # leaving the block closes the connection
        return received

    async def give_up_waiting(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"Essay number {i}:", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=body, timeout=3.0)

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=api_server.base_url, verify=api_server.tls,
                                     timeout=300,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            streamed = asyncio.gather(*(leave_mid_stream(client, i) for i in range(20)))
            waited = asyncio.gather(*(give_up_waiting(client, i) for i in range(4)))
            return (await asyncio.gather(streamed, waited))[0]

    assert asyncio.run(run()) == [3] * 20
    free, total = wait_all_blocks_free(grpc_client, timeout=60)
    assert free == total
