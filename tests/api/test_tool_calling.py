"""tools / tool_choice: the plan of each choice, its JSON schema, and the chat template's input.

- ``plan_tool_calls``: the defaults (auto with tools, none without), auto
  refused without a server parser, ``required``'s array schema (checked with
  ``jsonschema`` on arrays it must accept and refuse), a named choice's
  schema (the function's parameters);
- gRPC (``RequestPreparer.prepare`` of a ``Chat`` with ``tool_choice_mode`` /
  ``tool_choice_function``): the same plans and checks as the HTTP API, the
  plan's schema as the request's structured outputs, each refusal naming
  its ``chat.*`` field;
- ``RequestPreparer.render_chat``: a template that prints tools, an
  assistant's calls (arguments as objects) and tool answers gets them from a
  ``pb.Chat``; bad JSON text in a call or a tool's parameters is refused
  naming the field.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import PreTrainedTokenizerFast

from jaxserve.api.prompts import RequestPreparer
from jaxserve.api.tool_calling import (AUTO_NEEDS_FLAGS, NO_PARAMETERS, ToolChoiceError,
                                       check_tool_choice, plan_tool_calls, required_schema)
from jaxserve.api.tool_parsers import (HermesToolParser, JsonArrayToolParser,
                                       NamedToolCallStream, ToolCall, ToolCallStream)
from jaxserve.proto import generate_pb2 as pb
from jaxserve.validation import InvalidArgument
from tests.api.tokenizer_cases import byte_level_tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
FUNCTIONS = {"get_weather": WEATHER, "get_time": None}


def test_the_default_is_auto_with_tools_and_none_without():
    assert plan_tool_calls({}, None, auto_parser=None).mode == "none"
    parser = HermesToolParser()
    plan = plan_tool_calls(FUNCTIONS, None, auto_parser=parser)
    assert plan.mode == "auto" and plan.parser is parser and plan.schema is None
    assert isinstance(plan.stream(), ToolCallStream)
    none = plan_tool_calls(FUNCTIONS, "none", auto_parser=parser)
    assert not none.parses and none.stream() is None and none.extract("x") == ("x", [])


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_needs_a_server_parser(choice):
    with pytest.raises(ToolChoiceError) as err:
        plan_tool_calls(FUNCTIONS, choice, auto_parser=None)
    assert str(err.value) == AUTO_NEEDS_FLAGS


def test_required_is_an_array_of_calls_each_following_its_functions_schema():
    plan = plan_tool_calls(FUNCTIONS, "required", auto_parser=None)
    assert isinstance(plan.parser, JsonArrayToolParser)
    assert plan.schema == required_schema(FUNCTIONS)
    validator = jsonschema.Draft202012Validator(plan.schema)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}},
            {"name": "get_time", "parameters": {}}]
    validator.validate(good)
    for bad in ([], [{"name": "get_weather", "parameters": {"city": "Oslo"}}],
                [{"name": "get_wind", "parameters": {}}],
                [{"name": "get_time", "parameters": {}, "extra": 1}],
                [{"name": "get_time"}], {"name": "get_time", "parameters": {}}):
        assert not validator.is_valid(bad), bad
    one = plan_tool_calls(FUNCTIONS, "required", auto_parser=None, parallel=False).schema
    assert one["maxItems"] == 1 and not jsonschema.Draft202012Validator(one).is_valid(good)
    content, calls = plan.extract(json.dumps(good, separators=(",", ":")))
    assert content is None and calls == [
        ToolCall("get_weather", '{"city": "Oslo", "unit": "celsius"}'), ToolCall("get_time", "{}")]


def test_auto_without_parallel_tool_calls_keeps_the_first_call():
    plan = plan_tool_calls(FUNCTIONS, "auto", auto_parser=HermesToolParser(), parallel=False)
    two = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert plan.extract(two) == (None, [ToolCall("get_time", "{}")])
    deltas = plan.stream().push(two, final=True)
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0]


def test_named_is_the_functions_arguments():
    plan = plan_tool_calls(FUNCTIONS, {"name": "get_weather"}, auto_parser=None)
    assert plan.mode == "named" and plan.schema == WEATHER and plan.parser is None
    assert plan.extract('{"city":"Oslo","unit":"celsius"}') == (
        None, [ToolCall("get_weather", '{"city":"Oslo","unit":"celsius"}')])
    assert isinstance(plan.stream(), NamedToolCallStream)
    assert plan_tool_calls(FUNCTIONS, {"name": "get_time"}, auto_parser=None).schema == dict(
        NO_PARAMETERS)


NL = "{{ '\\n' }}"  # a newline that jinja's "{%-" does not trim
TEMPLATE = (
    "{%- if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}"
    "{{ t.function.parameters | tojson }}{% endfor %}" + NL + "{% endif %}"
    "{%- for m in messages %}{{ m.role }}: {{ m.content }}"
    "{%- for c in m.tool_calls or [] %} [{{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments.city }}]{% endfor %}"
    "{%- if m.tool_call_id %} [answers {{ m.tool_call_id }}]{% endif %}" + NL + "{% endfor %}"
    "{%- if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def preparer():
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(),
                                        chat_template=TEMPLATE)
    return RequestPreparer(tokenizer, vocab_size=420, max_model_len=512, eos_token_ids=(),
                           max_num_seqs=1)


def _chat(arguments: str = '{"city": "Oslo", "unit": "celsius"}',
          parameters: str = json.dumps(WEATHER)) -> pb.Chat:
    return pb.Chat(tools=[pb.Tool(name="get_weather", description="weather now",
                                  parameters=parameters)], messages=[
        pb.ChatMessage(role="user", content="Weather in Oslo?"),
        pb.ChatMessage(role="assistant", tool_calls=[
            pb.ToolCall(id="call-1", name="get_weather", arguments=arguments)]),
        pb.ChatMessage(role="tool", content="sunny, 20 C", tool_call_id="call-1")])


def test_the_template_gets_tools_calls_and_answers(preparer):
    assert preparer.render_chat(_chat()) == (
        f"TOOLS: get_weather{json.dumps(WEATHER)}\n"
        "user: Weather in Oslo?\n"
        "assistant:  [call-1 get_weather Oslo]\n"  # the arguments reach it as an object
        "tool: sunny, 20 C [answers call-1]\n"
        "assistant:")
    plain = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])
    assert preparer.render_chat(plain) == "user: hi\nassistant:"  # no tools: none passed


@pytest.mark.parametrize("chat,field", [
    (_chat(arguments="{\"city\": "), "chat.messages[1].tool_calls[0].arguments"),
    (_chat(arguments="[]"), "chat.messages[1].tool_calls[0].arguments"),
    (_chat(parameters="not json"), "chat.tools[0].parameters"),
    (pb.Chat(messages=[pb.ChatMessage(role="user", content="x")], tools=[pb.Tool()]),
     "chat.tools[0].name"),
])
def test_bad_json_in_a_chat_names_the_field(preparer, chat, field):
    with pytest.raises(InvalidArgument) as err:
        preparer.render_chat(chat)
    assert err.value.field == field


def _tool_request(*, mode: str | None = None, function: str | None = None,
                  parallel: bool | None = None, tools: tuple[str, ...] = ("get_weather",),
                  **sampling) -> pb.GenerateRequest:
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Weather in Oslo?")],
                   tools=[pb.Tool(name=name, parameters=json.dumps(WEATHER)) for name in tools])
    if mode is not None:
        chat.tool_choice_mode = mode
    if function is not None:
        chat.tool_choice_function = function
    if parallel is not None:
        chat.parallel_tool_calls = parallel
    return pb.GenerateRequest(chat=chat, sampling_params=pb.SamplingParams(**sampling))


def test_grpc_tool_choice_constrains_the_request(preparer):
    """required / named over gRPC: the plan's schema is the request's structured outputs
    (as over HTTP); parallel_tool_calls false allows one call; none leaves it free."""
    required = preparer.prepare(_tool_request(mode="required", parallel=False))
    assert required.tools.mode == "required" and required.tools.max_calls == 1
    assert required.params.structured_outputs.json == required_schema(
        {"get_weather": WEATHER}, parallel=False)
    named = preparer.prepare(_tool_request(function="get_weather"))
    assert named.tools.mode == "named" and named.params.structured_outputs.json == WEATHER
    free = preparer.prepare(_tool_request(mode="none"))
    assert not free.tools.parses and free.params.structured_outputs is None


def test_grpc_auto_reads_special_tokens_unless_told_otherwise(preparer):
    parser = HermesToolParser()
    assert parser.needs_special_tokens
    auto = preparer.prepare(_tool_request(), tool_parser=parser)  # left out: auto
    assert auto.tools.mode == "auto" and auto.tools.parser is parser
    assert auto.params.skip_special_tokens is False
    told = preparer.prepare(_tool_request(mode="auto", skip_special_tokens=True),
                            tool_parser=parser)
    assert told.params.skip_special_tokens is True


@pytest.mark.parametrize("request_, field, words", [
    (_tool_request(), "chat.tool_choice_mode", AUTO_NEEDS_FLAGS),
    (_tool_request(mode="sometimes"), "chat.tool_choice_mode", "must be one of none, auto"),
    (_tool_request(mode="required", tools=()), "chat.tool_choice_mode",
     "tool_choice 'required' needs tools"),
    (_tool_request(function="get_time"), "chat.tool_choice_function",
     "names the function 'get_time', which is not one of tools: get_weather"),
    (_tool_request(mode="none", tools=("f", "f")), "chat.tools", "two tools are named 'f'"),
    (_tool_request(mode="none", tools=("get weather",)), "chat.tools[0].name",
     "1-64 of A-Z a-z 0-9 _ -, got 'get weather'"),
    (_tool_request(mode="none", tools=("f" * 65,)), "chat.tools[0].name", "1-64 of"),
    (_tool_request(function="get_weather", structured_outputs=pb.StructuredOutputs(regex="a")),
     "chat.tool_choice_function", "a named tool_choice ('get_weather') constrains the output"),
    (_tool_request(mode="required", structured_outputs=pb.StructuredOutputs(regex="a+")),
     "chat.tool_choice_mode", "cannot go with sampling_params.structured_outputs"),
])
def test_grpc_tool_choice_errors_name_the_field(preparer, request_, field, words):
    with pytest.raises(InvalidArgument) as err:
        preparer.prepare(request_)
    assert err.value.field == field and words in str(err.value)


def test_check_tool_choice_is_the_one_rule_of_both_apis():
    check_tool_choice([], None)
    check_tool_choice([], "none")
    check_tool_choice(["f"], {"name": "f"})
    for names, choice in (([], "auto"), (["f"], {"name": "g"}), (["f"], "always")):
        with pytest.raises(ToolChoiceError):
            check_tool_choice(names, choice)
