"""Units of the api process: the request tracker, the server's limits, no jax in any server module.

The tracker is fed engine outputs one token at a time (the demo tokenizer,
ids of a real text); its responses must concatenate to the tokenizer's own
decode, cut at a stop string, with the ids and logprobs after the stop
dropped. Nothing here starts a server (tests/e2e/ does).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve.api.completions import RequestTracker
from jaxserve.api.prompts import RequestPreparer
from jaxserve.engine.messages import EngineCoreOutput, SampleLogprobs
from jaxserve.proto import generate_pb2 as pb
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_IDS, SamplingParams
from jaxserve.validation import InvalidArgument

TEXT = "Hello there, general Kenobi! The café serves crème brûlée — 東京 😀."
SERVER_MODULES = ["jaxserve.api.server", "jaxserve.api.generate_service",
                  "jaxserve.api.completions", "jaxserve.api.prompts", "jaxserve.api.engine_client",
                  "jaxserve.api.runner", "jaxserve.api.engine_group", "jaxserve.api.router",
                  "jaxserve.api.openai.app", "jaxserve.api.openai.serving",
                  "jaxserve.metrics", "jaxserve.launcher", "jaxserve.procutil",
                  "jaxserve.engine.service", "jaxserve.engine.loop", "jaxserve.engine.grpc_worker",
                  "jaxserve.proto.engine_convert", "jaxserve.commands.serve",
                  "jaxserve.commands.demo", "jaxserve.commands.generate", "jaxserve.commands.chat",
                  "jaxserve.generation_config", "jaxserve.model_files"]


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    from jaxserve.api.server import load_tokenizer

    return load_tokenizer(str(demo_model_dir))


def _outputs(ids, *, finish="length", logprobs=False):
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        lp = [SampleLogprobs(-0.1 * i, 1, (token, 7), (-0.1 * i, -5.0))] if logprobs else None
        yield EngineCoreOutput("r", 0, [token], lp, finish if last else None, None, 3, 0)


def _run(tracker, outputs):
    responses, aborted = [], []
    for out in outputs:
        got, abort = tracker.accept(out)
        responses += got
        if abort:
            aborted.append(out.index)
        if tracker.done:
            break
    return responses, aborted


def test_streamed_responses_concatenate_to_the_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    tracker = RequestTracker("r", tokenizer, [1, 2, 3], SamplingParams(max_tokens=len(ids)),
                             stream=True, arrival_time=0.0)
    responses, aborted = _run(tracker, _outputs(ids))
    assert "".join(r.text for r in responses) == tokenizer.decode(ids) == TEXT
    assert [t for r in responses for t in r.token_ids] == ids
    assert [r.HasField("finished") for r in responses] == [False] * (len(responses) - 1) + [True]
    fin = responses[-1].finished
    assert (fin.reason, fin.completion_tokens, fin.prompt_tokens) == (
        pb.FINISH_REASON_LENGTH, len(ids), 3)
    assert not aborted and tracker.done
    assert any(r.token_ids and not r.text for r in responses)  # a split character held back


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text_ids_and_logprobs_and_asks_for_an_abort(tokenizer, include):
    ids = tokenizer.encode(TEXT)
    stop = "ème br"  # starts inside a token, spans several
    params = SamplingParams(max_tokens=len(ids), stop=[stop], logprobs=1,
                            include_stop_str_in_output=include)
    tracker = RequestTracker("r", tokenizer, [1, 2, 3], params, stream=False, arrival_time=0.0)
    responses, aborted = _run(tracker, _outputs(ids, logprobs=True))
    assert len(responses) == 1 and aborted == [0]
    (r,) = responses
    cut = TEXT.index(stop) + (len(stop) if include else 0)
    assert r.text == TEXT[:cut]
    n = len(r.token_ids)
    assert r.token_ids == ids[:n] and stop in tokenizer.decode(ids[:n])
    assert stop not in tokenizer.decode(ids[:n - 1])
    assert len(r.logprobs) == n and r.logprobs[-1].top_token_ids == [ids[n - 1], 7]
    assert (r.finished.reason, r.finished.stop_string) == (pb.FINISH_REASON_STOP, stop)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_go_in_each_completions_first_response(tokenizer, stream):
    prompt_lp = [SampleLogprobs(-1.0, 2, (5,), (-0.5,)), SampleLogprobs(-0.25, 1, (7,), (-0.25,))]
    params = SamplingParams(n=2, max_tokens=2, prompt_logprobs=1)
    tracker = RequestTracker("r", tokenizer, [1, 7, 9], params, stream=stream, arrival_time=0.0)
    outputs = [EngineCoreOutput("r", 0, [11], num_prompt_tokens=3, prompt_logprobs=prompt_lp),
               EngineCoreOutput("r", 1, [12], num_prompt_tokens=3),
               EngineCoreOutput("r", 0, [13], finish_reason="length", num_prompt_tokens=3),
               EngineCoreOutput("r", 1, [14], finish_reason="length", num_prompt_tokens=3)]
    responses = [r for out in outputs for r in tracker.accept(out)[0]]
    for index in (0, 1):
        mine = [r for r in responses if r.index == index]
        assert [len(r.prompt_logprobs) for r in mine] == [2] + [0] * (len(mine) - 1)
        first = mine[0].prompt_logprobs
        assert [(lp.logprob, lp.rank, list(lp.top_token_ids)) for lp in first] == [
            (-1.0, 2, [5]), (-0.25, 1, [7])]


def test_abort_finishes_every_completion(tokenizer):
    ids = tokenizer.encode(TEXT)[:5]
    tracker = RequestTracker("r", tokenizer, [1], SamplingParams(n=2, max_tokens=50),
                             stream=True, arrival_time=0.0)
    for out in _outputs(ids, finish=None):
        tracker.accept(out)
    responses = tracker.abort()
    assert [r.index for r in responses] == [0, 1]
    assert all(r.finished.reason == pb.FINISH_REASON_ABORT for r in responses)
    assert responses[0].finished.completion_tokens == 5 and tracker.done


def test_server_limits_name_the_field(tokenizer):
    prep = RequestPreparer(tokenizer, vocab_size=49152, max_model_len=64, eos_token_ids=[2],
                           max_num_seqs=4)
    ids = list(range(100, 100 + MAX_STOP_IDS))
    check = prep.limits.check_params
    check(SamplingParams(stop_token_ids=ids, ignore_eos=True))  # EOS not counted
    check(SamplingParams(stop_token_ids=ids[:-1]))
    check(SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)}))
    cases = [(SamplingParams(stop_token_ids=ids), "sampling_params.stop_token_ids"),
             (SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
              "sampling_params.logit_bias"),
             (SamplingParams(n=5), "sampling_params.n")]
    for params, field in cases:
        with pytest.raises(InvalidArgument) as err:
            check(params)
        assert err.value.field == field and str(err.value).startswith(field + ":")
    check(SamplingParams(prompt_logprobs=0))  # accepted
    request = pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(max_tokens=70))
    with pytest.raises(InvalidArgument) as err:
        prep.prepare(request)
    assert err.value.field == "sampling_params.max_tokens"
    request.sampling_params.ClearField("max_tokens")
    prepared = prep.prepare(request)
    assert prepared.prompt_token_ids == tokenizer.encode("Hi")
    assert prepared.params.max_tokens == 64 - len(prepared.prompt_token_ids)


def test_model_defaults_fill_what_a_request_leaves_unset(tokenizer, tmp_path):
    from jaxserve.generation_config import load_sampling_defaults

    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.3, "max_new_tokens": 8}')
    prep = RequestPreparer(tokenizer, vocab_size=49152, max_model_len=64, eos_token_ids=[2],
                           max_num_seqs=4, defaults=load_sampling_defaults(tmp_path))
    params = prep.sampling_params({"top_p": 0.5, "seed": 3, "max_tokens": None})
    assert (params.temperature, params.top_p, params.repetition_penalty, params.seed,
            params.max_tokens) == (0.2, 0.5, 1.3, 3, None)
    assert prep.sampling_params({"temperature": 0.0}).temperature == 0.0  # explicit wins
    with pytest.raises(InvalidArgument) as err:
        prep.sampling_params({"top_p": 1.5})
    assert err.value.field == "sampling_params.top_p"

    # Through prepare (the gRPC path): the wire's absent fields take the defaults.
    wire = pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(top_k=5))
    prepared = prep.prepare(wire)
    assert (prepared.params.temperature, prepared.params.top_p, prepared.params.top_k,
            prepared.params.max_tokens) == (0.2, 0.9, 5, 8)
    wire.sampling_params.max_tokens = 20
    wire.sampling_params.temperature = 1.0
    explicit = prep.prepare(wire).params
    assert (explicit.max_tokens, explicit.temperature) == (20, 1.0)

    # The default reply length never makes a request too long: capped at the room left.
    long_prompt = list(range(100, 160))
    assert prep.validate(long_prompt, prep.sampling_params({})).max_tokens == 64 - 60
    plain = RequestPreparer(tokenizer, vocab_size=49152, max_model_len=64, eos_token_ids=[2],
                            max_num_seqs=4)
    assert plain.prepare(pb.GenerateRequest(text="Hi")).params.temperature == 1.0
    with pytest.raises(InvalidArgument, match="sampling_params.min_p"):
        RequestPreparer(tokenizer, vocab_size=49152, max_model_len=64, eos_token_ids=[2],
                        max_num_seqs=4, defaults={"min_p": 2.0})


def test_server_modules_and_the_tokenizer_never_import_jax(demo_model_dir):
    code = ("import sys\n" + "".join(f"import {m}\n" for m in SERVER_MODULES)
            + "from jaxserve.api.server import load_tokenizer\n"
            + f"load_tokenizer({str(demo_model_dir)!r}).encode('hello')\n"
            + "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', "
              "'jaxlib', 'flax')))\n"
            + "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_a_busy_metrics_port_fails_at_once_with_a_one_line_error(demo_model_dir):
    """The api binds ``--metrics-port`` before it waits for the engine (none runs here)."""
    import socket

    from jaxserve.procutil import free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "jaxserve.api.server", "--engine-address", "127.0.0.1:9",
             "--model", str(demo_model_dir), "--port", str(free_port()),
             "--metrics-port", str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"--metrics-port {port}: cannot listen" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_undecodable_request_bytes_reach_the_handler_as_a_value():
    # Regression (found by tests/e2e/test_fuzz_server.py): gRPC answered UNKNOWN when the
    # request's bytes did not parse; the api's decoders hand the handler a value instead,
    # which it refuses with INVALID_ARGUMENT.
    from jaxserve.api.server import _decoder, _Undecodable

    decode = _decoder(pb.GenerateRequest)
    assert decode(pb.GenerateRequest(text="hi").SerializeToString()).text == "hi"
    for wire, why in ((b"\x12\x02\xff\xfe", "UTF-8"), (b"\xff\xff\xff\xff", "")):
        bad = decode(wire)
        assert isinstance(bad, _Undecodable) and bad.message == "jaxserve.GenerateRequest"
        assert why in bad.error


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_an_over_long_prompt_is_refused_without_the_tokenizers_indexing_warning(
        demo_model_dir, capfd, caplog, kind):
    from jaxserve.api.server import load_tokenizer

    def logged() -> str:  # transformers' logger propagates, or writes to stderr itself
        text = caplog.text + capfd.readouterr().err
        caplog.clear()
        return text

    tokenizer = load_tokenizer(str(demo_model_dir))  # fresh: transformers warns once per instance
    long_text = "hello " * (tokenizer.model_max_length + 100)
    prep = RequestPreparer(tokenizer, vocab_size=49152, max_model_len=64, eos_token_ids=[2],
                           max_num_seqs=4)
    request = (pb.GenerateRequest(text=long_text) if kind == "text" else pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=long_text)])))
    with pytest.raises(InvalidArgument) as err:
        prep.prepare(request)
    assert "64" in str(err.value)
    assert "indexing errors" not in logged()
    tokenizer.encode(long_text)  # the warning this test looks for is seen when given
    assert "indexing errors" in logged()
