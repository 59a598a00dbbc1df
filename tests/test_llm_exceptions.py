"""``LLM.generate`` / ``chat`` leave the engine empty when their step loop is interrupted.

An exception or a ``KeyboardInterrupt`` raised from inside the step loop
(here: the engine's ``step`` replaced by one that raises on its third call)
aborts every request of that call: no request is left unfinished, every KV
block is free again, and the next call's greedy outputs equal those of a
fresh ``LLM``. The worker is the jax-free ``FakeWorker``
(tests/engine/fake_worker.py: its "model" is a digest of the context), so
the module runs in seconds; the tokenizer is the demo model's. Parameters the
worker's sampler cannot run are refused by ``add_request`` before any step
(the worker would refuse the step, and a refused step leaves it unusable).
"""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.engine.fake_worker import FakeWorker

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
VOCAB = 49152  # the demo tokenizer's: chat prompts and outputs decode
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]


def _llm(demo_model_dir, async_scheduling: bool) -> LLM:
    return LLM(str(demo_model_dir), worker=FakeWorker(max_model_len=128, vocab_size=VOCAB), max_model_len=128,
               max_num_seqs=8, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64,
               token_buckets=(1, 4, 8, 16), request_buckets=(1, 2, 4, 8),
               async_scheduling=async_scheduling)


def _raise_on_call(llm: LLM, monkeypatch, call: int, error: BaseException) -> None:
    """Makes the ``call``-th ``llm.engine.step()`` raise ``error`` (after stepping)."""
    step = llm.engine.step
    calls = [0]

    def failing_step():
        outputs = step()
        calls[0] += 1
        if calls[0] == call:
            raise error
        return outputs

    monkeypatch.setattr(llm.engine, "step", failing_step)


def _assert_engine_empty(llm: LLM) -> None:
    stats = llm.stats()
    assert not llm.engine.has_unfinished_requests()
    assert stats.num_waiting == stats.num_running == 0
    assert stats.kv_blocks_used == 0
    assert stats.kv_blocks_free + stats.kv_blocks_cached == stats.kv_blocks_total


def _token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("boom")],
                         ids=["KeyboardInterrupt", "RuntimeError"])
def test_interrupted_generate_leaves_the_engine_empty(demo_model_dir, monkeypatch,
                                                      async_scheduling, error):
    fresh = _llm(demo_model_dir, async_scheduling)
    want = _token_ids(fresh.generate(PROMPTS, GREEDY, use_tqdm=False))
    fresh.shutdown()

    llm = _llm(demo_model_dir, async_scheduling)
    with monkeypatch.context() as patch:
        _raise_on_call(llm, patch, 3, error)
        with pytest.raises(type(error)):
            llm.generate(PROMPTS + [[4, 4, 4]], [GREEDY] * 3 + [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2)],
                         use_tqdm=False)
        assert llm.engine.has_unfinished_requests() is False
    _assert_engine_empty(llm)
    assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    _assert_engine_empty(llm)
    llm.shutdown()


def test_interrupted_chat_leaves_the_engine_empty(demo_model_dir, monkeypatch):
    llm = _llm(demo_model_dir, async_scheduling=False)
    with monkeypatch.context() as patch:
        _raise_on_call(llm, patch, 2, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    _assert_engine_empty(llm)
    llm.shutdown()


@pytest.mark.parametrize("bad", [dict(stop_token_ids=list(range(1, 20))),
                                 dict(logit_bias={i: 1.0 for i in range(70)}),
                                 dict(stop_token_ids=[VOCAB + 5])],
                         ids=["stop-ids-over-width", "logit-bias-over-width", "stop-id-outside"])
def test_parameters_the_sampler_cannot_run_are_refused_before_any_step(demo_model_dir, bad):
    llm = _llm(demo_model_dir, async_scheduling=False)
    with pytest.raises(ValueError, match="stop_token_ids|logit_bias"):
        llm.generate(PROMPTS, [GREEDY, GREEDY, SamplingParams(max_tokens=4, **bad)],
                     use_tqdm=False)
    _assert_engine_empty(llm)
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == len(PROMPTS)
    llm.shutdown()


@pytest.mark.parametrize("call", ["generate", "generate_dict", "chat"])
def test_text_without_utf8_is_refused_naming_the_field(demo_model_dir, call):
    """A lone UTF-16 surrogate has no UTF-8 form: a ValueError naming the field, nothing queued."""
    llm = _llm(demo_model_dir, async_scheduling=False)
    text = "a\ud800b"
    with pytest.raises(ValueError, match=r"^(prompt|messages): not valid Unicode text"):
        if call == "generate":
            llm.generate([text], GREEDY, use_tqdm=False)
        elif call == "generate_dict":
            llm.generate([{"prompt": text}], GREEDY, use_tqdm=False)
        else:
            llm.chat([{"role": "user", "content": text}], GREEDY, use_tqdm=False)
    _assert_engine_empty(llm)
    assert _token_ids(llm.generate(["a\U0001f600b"], GREEDY, use_tqdm=False))[0]  # a pair is fine
    llm.shutdown()
