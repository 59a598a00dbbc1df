"""``GrammarCompiler`` on its own (no model): what llguidance refuses becomes a ``GrammarError``.

The demo model's tokenizer; V = its vocabulary. Every way llguidance refuses
a constraint (``ValueError``, plain ``Exception``, ``GbnfToLarkError``, a
matcher in error) is a ``GrammarError`` naming the field; a Lark grammar
with ``::=`` in a literal or a comment stays Lark.
"""

from __future__ import annotations

import pytest

from jaxserve.engine.grammar import GrammarCompiler, GrammarError, is_gbnf
from jaxserve.structured_outputs import StructuredOutputsParams


@pytest.fixture(scope="module")
def compiler(demo_model_dir):
    compiler = GrammarCompiler(demo_model_dir, vocab_size=49152, eos_token_ids=(2,))
    yield compiler
    compiler.shutdown()


def _check(compiler, **field):
    compiler.check(StructuredOutputsParams(**field), timeout=60)


@pytest.mark.parametrize("grammar", [
    'root ::= foo',            # llguidance: plain Exception "Rule 'foo' not found"
    'root ::= [a-',            # GbnfToLarkError
    'x ::= "a"',               # plain Exception "No 'root' rule found"
    'start: undefined_rule',   # a Lark matcher in error
])
def test_a_bad_grammar_is_a_grammar_error_naming_the_field(compiler, grammar):
    with pytest.raises(GrammarError) as info:
        _check(compiler, grammar=grammar)
    assert info.value.field == "sampling_params.structured_outputs.grammar"
    assert str(info.value)


@pytest.mark.parametrize("grammar, gbnf", [
    ('start: "a ::= b"', False),
    ('// x ::= y\nstart: "a"', False),
    ('start: A\nA: "::="', False),
    ('root ::= "a" | "b"', True),
    ('  root ::= x\nx ::= "a"', True),
    ('root::= "a"', True),
])
def test_gbnf_is_told_from_lark_by_its_rule_lines(compiler, grammar, gbnf):
    assert is_gbnf(grammar) == gbnf
    _check(compiler, grammar=grammar)  # compiles in its own dialect


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}},
     "max is 2000"),  # llguidance's row limit, hit on the first token
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "accepts no output"),
])
def test_a_schema_that_fails_its_first_step_is_refused_at_compile_time(compiler, schema, message):
    with pytest.raises(GrammarError) as info:
        _check(compiler, json=schema)
    assert info.value.field == "sampling_params.structured_outputs.json"
    assert message in str(info.value) and "<state>" not in str(info.value)


def test_the_first_step_probe_leaves_good_grammars_alone(compiler):
    _check(compiler, json={"type": "object", "properties": {"a": {"type": "integer"}}})
    _check(compiler, regex="[a-z]+")   # many first tokens: the probe stops at a few
    _check(compiler, choice=["yes", "no"])
    _check(compiler, json_object=True)
    _check(compiler, json=True)  # JSON Schema's "true": any value, as the schema {}
    _check(compiler, json="true")
