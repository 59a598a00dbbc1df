"""``jaxserve.LLM`` on the demo model (float32, greedy): engine configurations agree.

The same 32 requests (16 share a 64-token system prompt) give token-for-token
identical greedy outputs with prefix caching on and off and with chunked-prefill
budgets of 16, 64 and 2048 tokens; the first 8 of them with a KV cache so small that
sequences are preempted (asserted) against a large one. The shared system
prompt's blocks are reused: the measured hit rate is >= 90% of the
shareable blocks. The API itself (prompt forms, per-prompt parameters, stop
strings, n > 1, logprobs, chat) runs on the baseline instance.

All LLM instances share one loaded model (``InProcessWorker(loaded)``);
outputs are short (8 tokens) to keep the module under a few minutes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.model.loader import load_model
from jaxserve.sampling_params import MAX_LOGIT_BIAS
from jaxserve.validation import InvalidArgument
from jaxserve.worker import InProcessWorker
from tests.demo_prompts import QUESTIONS, TEXTS

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
SYSTEM_TOKENS = 64
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def loaded(demo_model_dir):
    return load_model(demo_model_dir, "float32")


def _llm(demo_model_dir, loaded, **kwargs):
    args = dict(max_num_seqs=32, max_model_len=256, num_kv_blocks=320, block_size=BLOCK,
                max_num_batched_tokens=64, token_buckets=(1, 4, 8, 16, 32, 64))
    args.update(kwargs)
    return LLM(str(demo_model_dir), worker=InProcessWorker(loaded), **args)


@pytest.fixture(scope="module")
def baseline(demo_model_dir, loaded):
    llm = _llm(demo_model_dir, loaded)
    tok = llm.get_tokenizer()
    system = tok.encode(" ".join(["You are a careful assistant who answers briefly and "
                                  "politely, citing facts only when sure."] * 4))
    assert len(system) >= SYSTEM_TOKENS
    system = system[:SYSTEM_TOKENS]
    prompts = []
    for q, t in zip(QUESTIONS, TEXTS):
        prompts.append(system + tok.encode(" " + q))
        prompts.append(tok.encode(t))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return llm, prompts, outputs


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("kwargs", [
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16, token_buckets=(1, 4, 8, 16)),
    dict(max_num_batched_tokens=2048, token_buckets=(1, 4, 8, 16, 32, 64, 2048)),
], ids=["no_prefix_caching", "budget_16", "budget_2048"])
def test_greedy_outputs_identical_across_configs(demo_model_dir, loaded, baseline, kwargs):
    _, prompts, want = baseline
    llm = _llm(demo_model_dir, loaded, **kwargs)
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    llm.shutdown()


def test_tiny_kv_cache_preempts_and_outputs_stay_identical(demo_model_dir, loaded, baseline):
    _, prompts, want = baseline
    # The first 8 requests (4 with the system prompt) already overflow this cache and are
    # preempted (asserted below); all 32 only add steps of one or two demo-model sequences.
    prompts, want = prompts[:8], want[:8]
    # 25 blocks of 4 tokens (100 tokens): one sequence of max_model_len (96), a few prompts
    # at once; 8 new tokens take each sequence across block boundaries.
    llm = _llm(demo_model_dir, loaded, num_kv_blocks=26, block_size=4, max_model_len=96,
               max_num_batched_tokens=16, token_buckets=(1, 4, 8, 16))
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert _tokens(got) == _tokens(want)
    assert stats.kv_blocks_used == 0
    llm.shutdown()


def test_shared_system_prompt_hit_rate(baseline):
    llm, prompts, outputs = baseline
    shared = outputs[0::2]  # the 16 requests with the 64-token system prompt
    hit_blocks = sum(min(o.num_cached_tokens, SYSTEM_TOKENS) // BLOCK for o in shared[1:])
    shareable = (len(shared) - 1) * (SYSTEM_TOKENS // BLOCK)
    assert hit_blocks / shareable >= 0.9, (hit_blocks, shareable)
    assert all(o.num_cached_tokens == 0 for o in outputs[1::2])  # unrelated prompts: no hits
    assert llm.stats().prefix_cache_hits >= hit_blocks * BLOCK


def test_prompt_forms_params_stop_strings_n_and_logprobs(baseline):
    llm, prompts, outputs = baseline
    tok = llm.get_tokenizer()
    text = TEXTS[2]
    ids = tok.encode(text)
    by_text, by_ids, by_dict = llm.generate([text, ids, {"prompt_token_ids": ids}], GREEDY,
                                            use_tqdm=False)
    assert by_text.prompt == text and by_ids.prompt is None
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids
    want = outputs[5].outputs[0]  # TEXTS[2] is prompt 5 of the baseline
    for out in (by_text, by_ids, by_dict):
        assert out.finished and out.outputs[0].token_ids == want.token_ids
        assert out.outputs[0].text == want.text == tok.decode(want.token_ids,
                                                              skip_special_tokens=True)
    # A stop string cut from the text: the first word of the greedy completion.
    word = want.text.split()[1]
    stopped, longer = llm.generate(
        [ids, ids], [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=[word]),
                     SamplingParams(temperature=0.0, max_tokens=3)], use_tqdm=False)
    c = stopped.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", word)
    assert c.text == want.text[:want.text.index(word)]
    assert longer.outputs[0].token_ids == want.token_ids[:3]
    assert longer.outputs[0].finish_reason == "length"
    # n = 2 seeded samples with logprobs of the sampled token and the top 3.
    (sampled,) = llm.generate(ids, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=4,
                                                  logprobs=3), use_tqdm=False)
    assert [c.index for c in sampled.outputs] == [0, 1]
    for c in sampled.outputs:
        assert len(c.token_ids) == len(c.logprobs) == 4
        for token, lp in zip(c.token_ids, c.logprobs):
            assert token in lp and 3 <= len(lp) <= 4
            top = sorted((v for v in lp.values() if v.rank <= 3), key=lambda v: v.rank)
            assert [v.rank for v in top] == [1, 2, 3]
            assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
            assert lp[token].logprob <= top[0].logprob + 1e-6
        assert np.isclose(c.cumulative_logprob, sum(lp[t].logprob
                                                    for t, lp in zip(c.token_ids, c.logprobs)))
    assert llm.stats().kv_blocks_used == 0


def test_chat_applies_the_template(baseline):
    llm, _, _ = baseline
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (chat,) = llm.chat(messages, GREEDY, use_tqdm=False)
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.prompt == rendered
    assert chat.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    (plain,) = llm.generate(chat.prompt_token_ids, GREEDY, use_tqdm=False)
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert "Paris" in chat.outputs[0].text


def test_chat_passes_tools_and_tool_calls_to_the_template(baseline):
    """``tools`` reach the template; an assistant's call arguments (JSON text) reach it as an
    object, as vLLM passes them; arguments that are not JSON are refused naming the field."""
    llm, _, _ = baseline
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} "
                "{{ c.function.arguments.city }}]{% endfor %}{% endfor %}<assistant>")
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object",
                                              "properties": {"city": {"type": "string"}}}}}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    (chat,) = llm.chat(messages, GREEDY, use_tqdm=False, tools=tools, chat_template=template)
    assert chat.prompt == ("[tool get_weather]<user>Weather in Paris?<assistant>"
                           "[call get_weather Paris]<tool>sunny<assistant>")
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    bad = {**call, "function": {"name": "get_weather", "arguments": "{city: Paris}"}}
    with pytest.raises(InvalidArgument) as err:
        llm.chat([messages[0], {"role": "assistant", "content": "", "tool_calls": [bad]}],
                 GREEDY, use_tqdm=False, tools=tools, chat_template=template)
    assert err.value.field == "messages[1].tool_calls[0].function.arguments"


def test_a_refused_prompt_queues_nothing_and_names_the_field(baseline):
    llm, _, _ = baseline
    vocab = llm.engine.geometry.vocab_size
    cases = [([[1, 2], [1, vocab]], GREEDY, "prompts[1]"),
             ([[1, 2], []], GREEDY, "prompts[1]"),
             ([[1, 2]], SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
              "sampling_params.logit_bias"),
             ([[1, 2]], SamplingParams(n=33), "sampling_params.n"),  # max_num_seqs 32
             ([[1, 2], [1, 2]], [GREEDY, SamplingParams(structured_outputs={"regex": "a(b"})],
              "sampling_params.structured_outputs.regex")]
    for prompts, params, field in cases:
        with pytest.raises(InvalidArgument) as err:
            llm.generate(prompts, params, use_tqdm=False)
        assert err.value.field == field
        assert not llm.engine.has_unfinished_requests()
    (ok,) = llm.generate([1, 2], GREEDY, use_tqdm=False)  # still serving
    assert ok.finished and 1 <= len(ok.outputs[0].token_ids) <= NEW_TOKENS


def test_structured_outputs_through_sampling_params(baseline):
    llm, _, _ = baseline
    schema = {"type": "object", "properties": {"answer": {"enum": ["Paris", "Lyon"]}},
              "required": ["answer"], "additionalProperties": False}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (chat,) = llm.chat(messages, SamplingParams(temperature=1.0, n=2, seed=4, max_tokens=24,
                                                structured_outputs={"json": schema}),
                       use_tqdm=False)
    for completion in chat.outputs:
        assert completion.finish_reason == "stop"
        assert json.loads(completion.text)["answer"] in ("Paris", "Lyon")


def test_masked_logprobs_are_floored_in_llm_outputs():
    """A token structured outputs masked (-inf) gets LOGPROB_FLOOR in ``Logprob``, as on the API."""
    import math
    import types

    from jaxserve.llm import _Pending
    from jaxserve.outputs import LOGPROB_FLOOR

    pending = _Pending.__new__(_Pending)
    pending.tokenizer = types.SimpleNamespace(decode=lambda ids: f"<{ids[0]}>")
    lp = types.SimpleNamespace(logprob=-math.inf, rank=3, top_token_ids=(4, 5),
                               top_logprobs=(-0.1, -math.inf))
    entries = pending._logprob_dict(6, lp)
    assert {t: e.logprob for t, e in entries.items()} == {4: -0.1, 5: LOGPROB_FLOOR,
                                                          6: LOGPROB_FLOOR}
