"""What the engine accepts, the worker runs: requests at every limit of ``jaxserve.validation``.

``EngineCore`` + ``InProcessWorker`` on a tiny random-weight Llama (V = 256,
EOS = 2). Requests sit exactly at each limit — ``MAX_LOGIT_BIAS`` logit-bias
entries, ``MAX_STOP_IDS`` stop ids counting EOS (banned by ``min_tokens``),
``max_tokens`` filling ``max_model_len``, ``n = max_num_seqs``, the largest
token ids, 20 logprobs — and all run to completion in one batch, with a KV
cache small enough that sequences are preempted and come back as new rows
(the worker re-checks them then). One past each limit is refused by
``add_request`` with the field named, and the engine keeps serving.
"""

from __future__ import annotations

import pytest

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.model.loader import load_model
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_IDS, SamplingParams
from jaxserve.validation import InvalidArgument
from jaxserve.worker import InProcessWorker
from tests.model.hf_tiny import make_tiny_model

MAX_LEN = 48
MAX_NUM_SEQS = 4
BLOCK = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_limits")
    make_tiny_model("LlamaForCausalLM", directory, seed=3)
    config = EngineConfig(
        max_model_len=MAX_LEN, seed=1,
        # One bucket each (fewer executables to compile): padding does not change what runs.
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=32,
                                  token_buckets=(32,), request_buckets=(MAX_NUM_SEQS,)),
        # 2 full-length sequences' blocks (+ the null block): 4 rows must preempt.
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=2 * MAX_LEN // BLOCK + 1))
    core = EngineCore(config, InProcessWorker(load_model(directory, "float32")))
    yield core
    core.shutdown()


def _run(core, requests):
    for request in requests:
        core.add_request(request)
    tokens, finish = {}, {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            if out.finished:
                finish[(out.request_id, out.index)] = out.finish_reason
    return tokens, finish


def test_requests_at_every_limit_run(engine):
    vocab, eos = engine.geometry.vocab_size, engine.geometry.eos_token_ids
    assert (vocab, len(eos)) == (256, 1)
    top = vocab - 1
    stops = [top - i for i in range(MAX_STOP_IDS - len(eos))]  # + EOS = MAX_STOP_IDS
    bias = {top - i: (-1.0) ** i * 5.0 for i in range(MAX_LOGIT_BIAS)}
    fill = dict(ignore_eos=True, temperature=0.0)
    requests = [
        EngineCoreRequest("bias", [top, 0, 7], SamplingParams(
            max_tokens=MAX_LEN - 3, logit_bias=bias, logprobs=MAX_LOGPROBS, **fill)),
        EngineCoreRequest("stops", [1, top, 3], SamplingParams(
            max_tokens=12, min_tokens=12, stop_token_ids=stops, temperature=0.8, seed=4)),
        EngineCoreRequest("stops_no_eos", [5] * 9, SamplingParams(
            max_tokens=MAX_LEN - 9, stop_token_ids=stops + [eos[0] + 1], **fill)),
        EngineCoreRequest("fill", list(range(MAX_LEN - 1)), SamplingParams(max_tokens=1)),
        EngineCoreRequest("n", [9, 8, 7, 6, 5], SamplingParams(
            n=MAX_NUM_SEQS, max_tokens=MAX_LEN - 5, temperature=1.0, seed=2, ignore_eos=True,
            logit_bias=bias)),
    ]
    tokens, finish = _run(engine, requests)
    assert engine.stats().num_preemptions > 0  # resumed rows were re-checked by the worker
    assert len(tokens[("bias", 0)]) == MAX_LEN - 3 and finish[("bias", 0)] == "length"
    assert len(tokens[("stops", 0)]) == 12  # min_tokens banned every stop id and EOS
    assert not set(tokens[("stops", 0)][:-1]) & set(stops + list(eos))
    assert finish[("stops_no_eos", 0)] in ("stop", "length")
    assert len(tokens[("fill", 0)]) == 1 and finish[("fill", 0)] == "length"
    for i in range(MAX_NUM_SEQS):
        assert len(tokens[("n", i)]) == MAX_LEN - 5 and finish[("n", i)] == "length"
    assert all(0 <= t < vocab for ids in tokens.values() for t in ids)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_one_past_each_limit_is_refused_and_the_engine_goes_on(engine):
    vocab, eos = engine.geometry.vocab_size, engine.geometry.eos_token_ids
    stops = list(range(10, 10 + MAX_STOP_IDS - len(eos) + 1))
    sp = "sampling_params."
    refused = [
        (SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), [1],
         sp + "logit_bias"),
        (SamplingParams(logit_bias={vocab: 1.0}), [1], sp + "logit_bias"),
        (SamplingParams(stop_token_ids=stops), [1], sp + "stop_token_ids"),
        (SamplingParams(stop_token_ids=[vocab]), [1], sp + "stop_token_ids"),
        (SamplingParams(n=MAX_NUM_SEQS + 1), [1], sp + "n"),
        (SamplingParams(), [1, vocab], "prompt_token_ids"),
        (SamplingParams(), list(range(MAX_LEN)), "prompt_token_ids"),
    ]
    for i, (params, prompt, field) in enumerate(refused):
        with pytest.raises(InvalidArgument) as err:
            engine.add_request(EngineCoreRequest(f"bad{i}", prompt, params))
        assert err.value.field == field
    # ignore_eos frees EOS's place: the same stop ids are accepted, and run.
    tokens, _ = _run(engine, [EngineCoreRequest("ok", [1, 2], SamplingParams(
        stop_token_ids=stops, ignore_eos=True, min_tokens=3, max_tokens=3))])
    assert len(tokens[("ok", 0)]) == 3
