"""Generation through the real server (worker, engine, api processes) on the demo model.

One server for the module: 64 sequences, 256-token steps, 512 KV blocks,
max_model_len 1024. The oracle is ``jaxserve.LLM`` in this process with the
same engine configuration (its greedy token ids) and the tokenizer's own
``decode`` of those ids.

- A streamed chat answer is coherent; its deltas concatenate to the
  non-streamed text, which is the tokenizer's decode of the token ids.
- Greedy tokens through gRPC, and through the OpenAI HTTP API, equal
  ``LLM.generate``'s, prompt by prompt.
- Stop strings that span three tokens or start inside one, with and without
  ``include_stop_str_in_output``, and emoji / CJK characters split across
  tokens (streamed, and as a stop string) give exactly the LLM's decoded
  text cut at the first occurrence.
- 64 concurrent streams with mixed parameters finish with the finish reason
  and stop reason their parameters force (length, EOS, min_tokens, a stop
  token id, a stop string, n = 2 seeded samples, logprobs, chat).
- Cancelling 50 running streams frees all their KV blocks (GetModelInfo).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import httpx
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.client import AsyncClient, Client
from jaxserve.client.types import build_generate_request
from jaxserve.proto import generate_pb2_grpc as pb_grpc
from jaxserve.procutil import free_port
from tests.e2e.helpers import serve, wait_all_blocks_free

pytestmark = pytest.mark.slow

ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=512,
              max_model_len=1024)
PROMPTS = ["The history of the printing press", "def add(a, b):", "Once upon a time",
           "The three primary colors are", "In 1969, astronauts", "A recipe for pancakes:",
           "Photosynthesis is the process", "Water boils at"]
MULTIBYTE_PROMPTS = ["😀😃😄😁😆", "北京是中国的首都。上海是"]
NEW_TOKENS = 16
STOP_TOKENS = 32
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(demo_model_dir):
    flags = tuple(x for k, v in ENGINE.items() for x in ("--" + k.replace("_", "-"), str(v)))
    with serve(demo_model_dir, flags, http_port=free_port()) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def llm(server, demo_model_dir):
    """The offline oracle, with the server's engine configuration (started after it)."""
    with LLM(str(demo_model_dir), **ENGINE) as offline:
        yield offline


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


def _llm_ids(llm, prompts, max_tokens, **params) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _stream(client, *args, **kwargs):
    """(deltas, joined text, joined token ids) of a streamed call."""
    deltas = list(client.stream(*args, **kwargs))
    return deltas, "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]


def test_streamed_chat_is_coherent_and_deltas_concatenate(client, tokenizer):
    deltas, text, ids = _stream(client, messages=CHAT, temperature=0.0, max_tokens=32)
    assert "Paris" in text
    assert len(deltas) > 3 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    result = client.chat(CHAT, temperature=0.0, max_tokens=32)
    assert text == result.text == tokenizer.decode(list(result.token_ids), skip_special_tokens=True)
    assert ids == list(result.token_ids)
    first, second = deltas[-1].usage, result.usage
    assert first.prompt_tokens == second.prompt_tokens
    assert first.completion_tokens == second.completion_tokens == len(ids)
    # The repeated prompt's full blocks come from the prefix cache.
    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == (second.prompt_tokens - 1) // 16 * 16
    assert deltas[-1].finish_reason == result.finish_reason


def test_greedy_tokens_match_the_offline_llm(server, llm, tokenizer):
    want = _llm_ids(llm, PROMPTS, NEW_TOKENS)

    async def generate_all():
        async with AsyncClient(server.address, timeout=300) as aclient:
            return await asyncio.gather(*(aclient.generate(p, temperature=0.0,
                                                           max_tokens=NEW_TOKENS)
                                          for p in PROMPTS))

    results = asyncio.run(generate_all())
    assert [list(r.token_ids) for r in results] == want
    assert [r.text for r in results] == [tokenizer.decode(w, skip_special_tokens=True)
                                         for w in want]


def test_greedy_tokens_over_http_match_grpc_and_the_offline_llm(server, client, llm, tokenizer):
    """One implementation, two transports: the OpenAI API's tokens are the gRPC service's."""
    want = _llm_ids(llm, PROMPTS[:4], NEW_TOKENS)
    base = f"http://127.0.0.1:{server.options.http_port}/v1"
    with httpx.Client(base_url=base, timeout=300) as http:
        for prompt, ids in zip(PROMPTS[:4], want):
            reply = http.post("/completions", json={
                "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0,
                "return_tokens_as_token_ids": True}).json()
            (choice,) = reply["choices"]
            assert [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]] == ids
            assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
            assert list(client.generate(prompt, max_tokens=NEW_TOKENS,
                                        temperature=0.0).token_ids) == ids


def _offsets(tokenizer, ids: list[int]) -> list[int]:
    """Characters of the decoded text after each prefix of ``ids`` (ASCII output)."""
    return [len(tokenizer.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids) + 1)]


def _stop_cases(tokenizer, ids: list[int]) -> list[str]:
    """A stop string starting inside a token and spanning three, and one inside one token."""
    full, off = tokenizer.decode(ids, skip_special_tokens=True), _offsets(tokenizer, ids)
    assert full.isascii() and off == sorted(off)
    for k in range(2, len(ids) - 3):
        if off[k + 1] - off[k] >= 3 and off[k + 2] > off[k + 1] and off[k + 3] - off[k + 2] >= 2:
            return [full[off[k] + 1:off[k + 2] + 1], full[off[k] + 1:off[k + 1]]]
    raise AssertionError(f"no token suits the stop strings in {full!r}")


@pytest.mark.parametrize("prompt", PROMPTS[:2])
@pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
def test_stop_strings_across_and_inside_tokens(client, llm, tokenizer, prompt, include):
    (ids,) = _llm_ids(llm, [prompt], STOP_TOKENS, ignore_eos=True)
    full, off = tokenizer.decode(ids, skip_special_tokens=True), _offsets(tokenizer, ids)
    for stop in _stop_cases(tokenizer, ids):
        at = full.find(stop)
        want_text = full[:at + len(stop)] if include else full[:at]
        last = next(i for i in range(len(ids) + 1) if off[i] >= at + len(stop))
        deltas, text, got_ids = _stream(client, prompt, temperature=0.0, max_tokens=STOP_TOKENS,
                                        ignore_eos=True, stop=[stop],
                                        include_stop_str_in_output=include)
        assert text == want_text, stop
        assert got_ids == ids[:last], stop
        assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)


def _clean_prefix(tokenizer, ids: list[int], at_least: int) -> list[int]:
    """The longest prefix (>= at_least tokens) whose decode ends on a whole character."""
    for m in range(len(ids), at_least - 1, -1):
        if "\ufffd" not in tokenizer.decode(ids[:m], skip_special_tokens=True):
            return ids[:m]
    raise AssertionError("no prefix decodes to whole characters")


@pytest.mark.parametrize("prompt", MULTIBYTE_PROMPTS, ids=["emoji", "cjk"])
def test_multibyte_characters_split_across_tokens(client, llm, tokenizer, prompt):
    (ids,) = _llm_ids(llm, [prompt], 24, ignore_eos=True)
    ids = _clean_prefix(tokenizer, ids, 12)
    # The test's premise: some characters are made of several tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    deltas, text, got_ids = _stream(client, prompt, temperature=0.0, max_tokens=len(ids),
                                    ignore_eos=True)
    assert got_ids == ids and text == full
    assert not any("\ufffd" in d.text for d in deltas)
    assert any(d.token_ids and not d.text for d in deltas)  # half a character: held back
    # A multi-token character as the stop string, from the middle of the text.
    wide = [c for c in dict.fromkeys(full) if len(tokenizer.encode(c)) > 1 and full.find(c) > 0]
    assert wide, full
    stop = wide[len(wide) // 2]
    deltas, text, _ = _stream(client, prompt, temperature=0.0, max_tokens=len(ids),
                              ignore_eos=True, stop=[stop])
    assert text == full[:full.find(stop)]
    assert deltas[-1].stop_reason == stop


def _mixed_requests(tokenizer) -> list[tuple[dict, Callable]]:
    """64 (request kwargs, check(result)) pairs whose finish reasons the parameters force."""
    eos = tokenizer.eos_token_id
    the = tokenizer.encode(" the")[0]
    paris = tokenizer.encode(" Paris")
    assert len(paris) == 1 and tokenizer.decode(paris) == " Paris"
    paris = paris[0]
    force = lambda t: {t: 100.0}  # noqa: E731

    def length(k):
        return lambda r: (r.finish_reason == "length" and r.usage.completion_tokens == k
                          and r.stop_reason is None)

    kinds = [
        lambda i: (dict(max_tokens=3 + i % 6, ignore_eos=True, temperature=0.0),
                   length(3 + i % 6)),
        lambda i: (dict(max_tokens=8, logit_bias=force(eos), temperature=0.0),
                   lambda r: (r.finish_reason, r.stop_reason, r.token_ids, r.text)
                   == ("stop", None, (eos,), "")),
        lambda i: (dict(max_tokens=8, min_tokens=3, logit_bias=force(eos), temperature=0.0),
                   lambda r: r.finish_reason == "stop" and len(r.token_ids) == 4
                   and r.token_ids[-1] == eos and eos not in r.token_ids[:3]),
        lambda i: (dict(max_tokens=8, logit_bias=force(the), stop_token_ids=[the]),
                   lambda r: (r.finish_reason, r.stop_reason, r.token_ids, r.text)
                   == ("stop", the, (the,), "")),
        lambda i: (dict(max_tokens=8, logit_bias=force(paris), stop=["ari"]),
                   lambda r: (r.finish_reason, r.stop_reason, r.token_ids, r.text)
                   == ("stop", "ari", (paris,), " P")),
        lambda i: (dict(n=2, temperature=0.8, seed=i // 8, max_tokens=6, ignore_eos=True),
                   lambda r: len(r.completions) == 2 and all(
                       c.finish_reason == "length" and len(c.token_ids) == 6
                       for c in r.completions)),
        lambda i: (dict(logprobs=3, max_tokens=5, ignore_eos=True, temperature=0.0),
                   lambda r: len(r.completions[0].logprobs) == 5 and all(
                       len(lp.top_token_ids) == 3 and lp.top_token_ids[0] == t
                       and abs(lp.logprob - lp.top_logprobs[0]) < 1e-5
                       for t, lp in zip(r.token_ids, r.completions[0].logprobs))),
        lambda i: (dict(messages=CHAT, max_tokens=12, temperature=0.0),
                   lambda r: r.finish_reason in ("stop", "length")
                   and r.text == tokenizer.decode(list(r.token_ids), skip_special_tokens=True)),
    ]
    return [kinds[i % len(kinds)](i) for i in range(64)]


def test_64_concurrent_streams_with_mixed_parameters(server, client, tokenizer):
    cases = _mixed_requests(tokenizer)

    async def run_one(aclient, i, kwargs):
        kwargs = dict(kwargs)
        prompt = None if "messages" in kwargs else f"Item {i}: the capital of France is"
        texts, ids, lps, last = {}, {}, {}, {}
        async for d in aclient.stream(prompt, **kwargs):
            texts[d.index] = texts.get(d.index, "") + d.text
            ids.setdefault(d.index, []).extend(d.token_ids)
            lps.setdefault(d.index, []).extend(d.logprobs)
            if d.finished:
                last[d.index] = d
        result = await aclient.generate(prompt, **kwargs) if kwargs.get("seed") is not None \
            else None
        return texts, ids, lps, last, result

    async def run_all():
        async with AsyncClient(server.address, timeout=600) as aclient:
            return await asyncio.gather(*(run_one(aclient, i, kw)
                                          for i, (kw, _) in enumerate(cases)))

    start = time.monotonic()
    outcomes = asyncio.run(run_all())
    elapsed = time.monotonic() - start
    failures = []
    for i, ((kwargs, check), (texts, ids, lps, last, again)) in enumerate(zip(cases, outcomes)):
        completions = [_Completion(texts[j], tuple(ids[j]), lps[j], last[j]) for j in sorted(last)]
        if not check(_Result(completions)):
            failures.append((i, kwargs, completions))
        if again is not None:  # a seeded request repeats exactly
            if [tuple(c.token_ids) for c in again.completions] != [c.token_ids
                                                                   for c in completions]:
                failures.append((i, "seeded request did not repeat"))
    assert not failures, failures[:4]
    assert elapsed < 300
    assert wait_all_blocks_free(client)[0] == client.model_info().num_kv_blocks_total


class _Completion:
    def __init__(self, text, token_ids, logprobs, last):
        self.text, self.token_ids, self.logprobs = text, token_ids, logprobs
        self.finish_reason, self.stop_reason, self.usage = (last.finish_reason, last.stop_reason,
                                                            last.usage)

    def __repr__(self):
        return f"<{self.finish_reason} {self.stop_reason!r} {self.token_ids} {self.text!r}>"


class _Result:
    """The streamed completions, shaped like ``GenerateResult`` for the checks."""

    def __init__(self, completions):
        self.completions = completions
        first = completions[0]
        self.text, self.token_ids = first.text, first.token_ids
        self.finish_reason, self.stop_reason, self.usage = (first.finish_reason,
                                                            first.stop_reason, first.usage)


def test_cancelling_50_running_streams_frees_all_blocks(server, client):
    total = client.model_info().num_kv_blocks_total
    params = dict(max_tokens=500, ignore_eos=True, temperature=0.0)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        calls = [stub.Generate(build_generate_request(
            f"Story number {i} begins:", messages=None, sampling_params=None, params=params,
            stream=True)) for i in range(50)]
        try:
            for call in calls:
                next(call)  # all 50 are running (max_num_seqs 64) and have produced a token
            info = client.model_info()
            assert total - info.num_kv_blocks_free >= 50
        finally:
            for call in calls:
                call.cancel()
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.CANCELLED
    free, total = wait_all_blocks_free(client)
    assert free == total
