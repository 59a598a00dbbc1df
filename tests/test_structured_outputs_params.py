"""StructuredOutputsParams and its place in SamplingParams: validation names the field."""

import pickle

import pytest

from jaxserve.proto.convert import sampling_params_kwargs_from_proto, sampling_params_to_proto
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams
from jaxserve.validation import InvalidArgument, sampling_params_from_kwargs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("kwargs", [
    {"json": SCHEMA}, {"json": '{"type": "string"}'}, {"json_object": True},
    {"regex": "[a-z]+"}, {"choice": ["yes", "no"]}, {"grammar": 'start: "a"+'},
])
def test_one_field_is_accepted_hashable_and_picklable(kwargs):
    so = StructuredOutputsParams(**kwargs)
    assert so.kind == next(iter(kwargs))
    sp = SamplingParams(structured_outputs=so)
    assert hash(sp) == hash(SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs)))
    assert pickle.loads(pickle.dumps(sp)) == sp
    assert SamplingParams.from_dict(sp.to_dict()) == sp


def test_dict_schema_and_its_text_share_a_cache_key_when_keys_sorted():
    a = StructuredOutputsParams(json={"b": 1, "type": "object"})
    b = StructuredOutputsParams(json={"type": "object", "b": 1})
    assert a.spec == b.spec and a == b


@pytest.mark.parametrize("kwargs, words", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"json": 3}, "structured_outputs.json"),
    ({"json": "false"}, "structured_outputs.json is the schema false, which no value matches"),
    ({"json": False}, "structured_outputs.json is the schema false, which no value matches"),
    ({"json": 3}, "an object, true, or its JSON text"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": "yes"}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"grammar": 7}, "structured_outputs.grammar"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
])
def test_bad_params_name_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        StructuredOutputsParams(**kwargs)


def test_dict_form_and_unknown_keys():
    sp = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert sp.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(ValueError, match=r"structured_outputs\.xml"):
        SamplingParams(structured_outputs={"xml": "<a/>"})


@pytest.mark.parametrize("kwargs, other", [({"ignore_eos": True}, "ignore_eos"),
                                           ({"min_tokens": 3}, "min_tokens")])
def test_combinations_that_cannot_hold_are_refused(kwargs, other):
    with pytest.raises(ValueError, match=f"structured_outputs.*{other}"):
        SamplingParams(structured_outputs={"json_object": True}, **kwargs)


def test_api_validation_maps_to_the_field():
    with pytest.raises(InvalidArgument) as info:
        sampling_params_from_kwargs({"structured_outputs": {"choice": []}})
    assert info.value.field == "sampling_params.structured_outputs.choice"
    with pytest.raises(InvalidArgument) as info:
        sampling_params_from_kwargs({"structured_outputs": {"regex": "a"}, "ignore_eos": True})
    assert info.value.field == "sampling_params.structured_outputs"


@pytest.mark.parametrize("so", [{"json": SCHEMA}, {"choice": ["x", "y"]}, {"json_object": True},
                                {"regex": "a+"}, {"grammar": 'start: "a"'}])
def test_proto_round_trip(so):
    sp = SamplingParams(structured_outputs=so, max_tokens=9)
    back = SamplingParams(**sampling_params_kwargs_from_proto(sampling_params_to_proto(sp)))
    assert back == sp
    assert SamplingParams(**sampling_params_kwargs_from_proto(
        sampling_params_to_proto({"structured_outputs": so}))).structured_outputs == \
        sp.structured_outputs


def test_python_client_kwarg_travels_in_the_request():
    from jaxserve.client.types import build_generate_request

    request = build_generate_request("hi", messages=None, sampling_params=None, stream=False,
                                     params={"structured_outputs": {"choice": ["a", "b"]}})
    assert list(request.sampling_params.structured_outputs.choice) == ["a", "b"]
    request = build_generate_request(
        "hi", messages=None, stream=False, params={},
        sampling_params=SamplingParams(structured_outputs={"json": SCHEMA}))
    assert sampling_params_kwargs_from_proto(request.sampling_params)["structured_outputs"] == {
        "json": __import__("json").dumps(SCHEMA)}
