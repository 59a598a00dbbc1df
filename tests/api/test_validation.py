"""Validation: every bad request field becomes an InvalidArgument naming that field.

Sampling parameters travel through the wire message (``SamplingParams`` proto
-> kwargs -> ``RequestPreparer.sampling_params``), as the server receives them.
"""

from __future__ import annotations

import math
import random

import grpc
import pytest

from jaxserve.api.prompts import RequestPreparer
from jaxserve.api.runner import ApiError, RequestRunner
from jaxserve.api.validation import validate_chat, validate_text
from jaxserve.metrics import ServerMetrics
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto.convert import (SAMPLING_FIELDS, sampling_params_kwargs_from_proto,
                                    sampling_params_to_proto)
from jaxserve.sampling_params import (LOGIT_BIAS_LIMIT, MAX_LOGPROBS, MAX_SEED, MIN_SEED,
                                      SamplingParams)
from jaxserve.validation import InvalidArgument, RequestLimits, sampling_params_from_kwargs

VOCAB, MAX_LEN = 1000, 64
LIMITS = RequestLimits(vocab_size=VOCAB, max_model_len=MAX_LEN, max_num_seqs=8)


# No model defaults, so a message's absent fields take SamplingParams' own.
PREPARER = RequestPreparer(None, vocab_size=VOCAB, max_model_len=MAX_LEN, eos_token_ids=(),
                           max_num_seqs=8)


def _from_wire(message: pb.SamplingParams) -> SamplingParams:
    """The server's path from the wire message to a validated ``SamplingParams``."""
    return PREPARER.sampling_params(sampling_params_kwargs_from_proto(message))


def _validate(prompt, params, *, prompt_field="token_ids", default_max_tokens=None):
    return LIMITS.validate(prompt, params, prompt_field=prompt_field,
                           default_max_tokens=default_max_tokens)

# (field, wire values): each must be rejected with INVALID_ARGUMENT naming sampling_params.<field>.
BAD_SAMPLING = [
    ("n", {"n": 0}), ("n", {"n": -3}),
    ("presence_penalty", {"presence_penalty": 2.5}), ("presence_penalty", {"presence_penalty": math.nan}),
    ("frequency_penalty", {"frequency_penalty": -3.0}),
    ("frequency_penalty", {"frequency_penalty": math.inf}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("temperature", {"temperature": -0.1}), ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("top_p", {"top_p": 0.0}), ("top_p", {"top_p": 1.01}), ("top_p", {"top_p": math.nan}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": -0.01}), ("min_p", {"min_p": 1.5}),
    ("stop", {"stop": [""]}), ("stop", {"stop": ["ok", ""]}),
    ("stop_token_ids", {"stop_token_ids": [5, -1]}),
    ("max_tokens", {"max_tokens": 0}), ("max_tokens", {"max_tokens": -5}),
    ("min_tokens", {"min_tokens": -1}), ("min_tokens", {"min_tokens": 9, "max_tokens": 8}),
    ("logprobs", {"logprobs": MAX_LOGPROBS + 1}), ("logprobs", {"logprobs": -1}),
    ("prompt_logprobs", {"prompt_logprobs": MAX_LOGPROBS + 1}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}), ("logit_bias", {"logit_bias": {5: math.nan}}),
    ("logit_bias", {"logit_bias": {5: 100.5}}), ("logit_bias", {"logit_bias": {5: -101.0}}),
    ("structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["a"]}}),
    ("structured_outputs", {"structured_outputs": {"regex": "a"}, "ignore_eos": True}),
    ("structured_outputs.json", {"structured_outputs": {"json": "{nope"}}),
    ("structured_outputs.choice", {"structured_outputs": {"choice": ["", "b"]}}),
    # proto3 drops an empty repeated field: the server still names choice
    ("structured_outputs.choice", {"structured_outputs": {"choice": []}}),
]
# Fields with no invalid wire value: bools, and seed (any uint64 is a seed).
ALWAYS_VALID = {"ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                "spaces_between_special_tokens", "seed"}


def test_every_sampling_field_has_a_bad_value_case():
    named = {field.split(".")[0] for field, _ in BAD_SAMPLING}
    assert named | ALWAYS_VALID == set(SAMPLING_FIELDS)


@pytest.mark.parametrize("field, values", BAD_SAMPLING)
def test_bad_sampling_param_over_the_wire_names_field(field, values):
    message = sampling_params_to_proto(values)
    with pytest.raises(InvalidArgument) as info:
        _from_wire(message)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.field == f"sampling_params.{field}"
    assert str(err).startswith(f"sampling_params.{field}: ") and err.reason
    assert not err.reason.startswith(field.split(".")[-1])  # the name is not repeated


def test_logit_bias_range_is_inclusive():
    bias = {5: LOGIT_BIAS_LIMIT, 6: -LOGIT_BIAS_LIMIT}
    assert _from_wire(sampling_params_to_proto({"logit_bias": bias})).logit_bias == bias


def test_unknown_or_mistyped_kwargs_name_field():
    with pytest.raises(InvalidArgument, match=r"^sampling_params\.temprature: unknown"):
        sampling_params_from_kwargs({"temprature": 0.5})
    with pytest.raises(InvalidArgument) as info:
        sampling_params_from_kwargs({"top_k": 2.5})
    assert info.value.field == "sampling_params.top_k"


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        n=rng.randrange(1, 4), presence_penalty=rng.uniform(-2, 2),
        frequency_penalty=rng.uniform(-2, 2), repetition_penalty=rng.uniform(0.5, 2),
        temperature=rng.choice([0.0, rng.uniform(0, 2)]), top_p=rng.uniform(0.01, 1),
        top_k=rng.choice([-1, 0, rng.randrange(1, 100)]), min_p=rng.uniform(0, 1),
        seed=rng.choice([None, rng.randrange(MIN_SEED, MAX_SEED + 1)]),
        stop=[f"s{rng.randrange(9)}" for _ in range(rng.randrange(3))],
        stop_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randrange(3))],
        ignore_eos=rng.random() < 0.5, max_tokens=rng.choice([None, rng.randrange(8, 40)]),
        min_tokens=rng.randrange(0, 8), logprobs=rng.choice([None, rng.randrange(0, 21)]),
        prompt_logprobs=rng.choice([None, rng.randrange(0, 21)]),
        logit_bias=rng.choice([None, {rng.randrange(VOCAB): rng.uniform(-5, 5)}]),
        include_stop_str_in_output=rng.random() < 0.5, skip_special_tokens=rng.random() < 0.5,
        spaces_between_special_tokens=rng.random() < 0.5)


def test_sampling_params_round_trip_over_the_wire():
    rng = random.Random(0)
    for _ in range(200):
        params = _random_params(rng)
        wire = pb.SamplingParams.FromString(sampling_params_to_proto(params).SerializeToString())
        back = _from_wire(wire)
        expected = params if params.seed is None else SamplingParams.from_dict(
            {**params.to_dict(), "seed": params.seed % 2**64})
        assert back == expected


def test_absent_fields_take_defaults_except_max_tokens():
    params = _from_wire(pb.SamplingParams())
    assert params == SamplingParams(max_tokens=None)
    # Presence: an explicit default-valued field is distinguishable from an absent one.
    message = pb.SamplingParams(temperature=0.0, skip_special_tokens=False)
    kwargs = sampling_params_kwargs_from_proto(message)
    assert kwargs == {"max_tokens": None, "temperature": 0.0, "skip_special_tokens": False}


def test_client_side_conversion_errors_name_field():
    with pytest.raises(ValueError, match=r"^max_tokens: cannot send"):
        sampling_params_to_proto({"max_tokens": 2**40})
    with pytest.raises(ValueError, match=r"^temprature: unknown"):
        sampling_params_to_proto({"temprature": 1.0})
    for seed in (MAX_SEED + 1, MIN_SEED - 1):  # never sent wrapped modulo 2**64
        with pytest.raises(ValueError, match=r"^seed: cannot send"):
            sampling_params_to_proto({"seed": seed})


# (prompt ids, params, field) for RequestLimits.validate with VOCAB / MAX_LEN.
BAD_REQUESTS = [
    ([], SamplingParams(), "token_ids"),
    ([1, VOCAB, 2], SamplingParams(), "token_ids"),
    ([1, -1], SamplingParams(), "token_ids"),
    (list(range(MAX_LEN)), SamplingParams(max_tokens=None), "token_ids"),
    (list(range(60)), SamplingParams(max_tokens=5), "sampling_params.max_tokens"),
    (list(range(60)), SamplingParams(max_tokens=None, min_tokens=5), "sampling_params.min_tokens"),
    ([1, 2], SamplingParams(stop_token_ids=[VOCAB + 3]), "sampling_params.stop_token_ids"),
    ([1, 2], SamplingParams(logit_bias={VOCAB: 1.0}), "sampling_params.logit_bias"),
    ([1, 2], SamplingParams(seed=MAX_SEED + 1), "sampling_params.seed"),
    ([1, 2], SamplingParams(seed=MIN_SEED - 1), "sampling_params.seed"),
    ([1, 2], SamplingParams(seed=2**70), "sampling_params.seed"),
]


@pytest.mark.parametrize("prompt, params, field", BAD_REQUESTS)
def test_bad_request_names_field(prompt, params, field):
    with pytest.raises(InvalidArgument) as info:
        _validate(prompt, params)
    assert info.value.field == field and str(info.value).startswith(field + ": ")


def test_prompt_field_name_follows_the_request():
    with pytest.raises(InvalidArgument, match=r"^chat\.messages: "):
        _validate([], SamplingParams(),                          prompt_field="chat.messages")


def test_seeds_of_64_bits_are_accepted():
    for seed in (MIN_SEED, -1, 0, 2**63 - 1, MAX_SEED):
        assert _validate([1, 2], SamplingParams(seed=seed)).seed == seed


def test_length_limits_exact():
    prompt = list(range(60))
    ok = _validate(prompt, SamplingParams(max_tokens=4))
    assert ok.max_tokens == 4  # 60 + 4 == 64 fits exactly
    resolved = _validate(prompt, SamplingParams(max_tokens=None, min_tokens=4))
    assert resolved.max_tokens == MAX_LEN - len(prompt) and resolved.min_tokens == 4
    edge = _validate(list(range(MAX_LEN - 1)), SamplingParams(max_tokens=None))
    assert edge.max_tokens == 1
    assert _validate([VOCAB - 1, 0], SamplingParams()) == SamplingParams()


def test_a_default_max_tokens_is_capped_by_the_room_and_raised_to_min_tokens():
    def resolve(prompt_len, default, **params):
        return _validate(list(range(prompt_len)), SamplingParams(max_tokens=None, **params),
                                default_max_tokens=default).max_tokens

    assert resolve(10, 8) == 8  # the default, room allowing
    assert resolve(60, 8) == MAX_LEN - 60  # never longer than the room left
    assert resolve(10, 8, min_tokens=12) == 12  # min_tokens is a floor
    assert resolve(10, None) == MAX_LEN - 10  # no default: the room left
    explicit = _validate(list(range(10)), SamplingParams(max_tokens=30), default_max_tokens=8)
    assert explicit.max_tokens == 30


def test_text_and_chat_checks():
    with pytest.raises(InvalidArgument, match=r"^text: "):
        validate_text("")
    validate_text("hi")
    with pytest.raises(InvalidArgument, match=r"^chat\.messages: "):
        validate_chat([])
    messages = [pb.ChatMessage(role="user", content="hi"), pb.ChatMessage(content="x")]
    with pytest.raises(InvalidArgument, match=r"^chat\.messages\[1\]\.role: "):
        validate_chat(messages)
    validate_chat(messages[:1])


def test_chat_roles_are_openais():
    validate_chat([pb.ChatMessage(role=role, content="x")
                   for role in ("system", "developer", "user", "assistant", "tool")])
    for role in ("User", "bot", "function", " user"):
        messages = [pb.ChatMessage(role="user", content="hi"), pb.ChatMessage(role=role)]
        with pytest.raises(InvalidArgument) as info:
            validate_chat(messages, field="messages")
        assert info.value.field == "messages[1].role" and repr(role) in info.value.reason


# (request, field): refused by the gRPC path (RequestRunner.prepare) with INVALID_ARGUMENT.
BAD_GRPC = [
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]),
                        sampling_params=pb.SamplingParams(logit_bias={5: 100.5})),
     "sampling_params.logit_bias"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="hi")])),
     "chat.messages[0].role"),
]


@pytest.mark.parametrize("generate_request, field", BAD_GRPC)
def test_bad_grpc_requests_are_invalid_argument(generate_request, field):
    runner = RequestRunner(None, PREPARER, model_name="m", metrics=ServerMetrics(lambda: None),
                           max_pending_seqs=8)
    with pytest.raises(ApiError) as info:
        runner.prepare(generate_request)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.field == field


def test_an_empty_choice_list_gets_the_same_message_on_every_transport():
    with pytest.raises(InvalidArgument) as wire:
        _from_wire(sampling_params_to_proto({"structured_outputs": {"choice": []}}))
    with pytest.raises(ValueError) as local:
        SamplingParams(structured_outputs={"choice": []})
    assert wire.value.reason.endswith("must hold at least one string")
    assert str(local.value).endswith(wire.value.reason)


@pytest.mark.parametrize("value", ["regex", ["choice", "a"], 3])
def test_structured_outputs_that_is_not_a_dict_is_a_type_error_naming_it(value):
    with pytest.raises(TypeError, match=r"^structured_outputs must be a dict .* got "):
        sampling_params_to_proto({"structured_outputs": value})
