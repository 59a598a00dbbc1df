"""Structured outputs through the engine: a tiny random-weight Llama with a real tokenizer.

At temperature 1.0 the random model would write anything; under its grammar
every JSON output parses and validates against its schema (``jsonschema``) —
200 outputs across 20 schemas (integers and numbers in ranges, booleans,
enums, bounded strings and arrays, nested objects, required and optional
fields, ``additionalProperties: false``) —
every regex output matches, every choice output is one of the choices — for
each of ``n`` sequences (each keeps its own matcher). A bad schema / regex /
grammar is refused naming the field, and the engine keeps serving. A seeded
unconstrained request draws the same tokens beside constrained ones (the
MASKED sampler's all-allowed rows are FULL's). Constrained rows that need only
temperature sampling run MASKED_SAMPLED (no threshold searches). The masked
samplers compiled in the background: the strict recompile guard sees no
compile in a step.
Preempted sequences resume with their own matcher; a steady masked step
makes one upload (buffer and bitmask) and one download. With constrained rows
in flight the next step is still scheduled while the device runs, and
submitted, its masks from the advanced matchers, once the step's result is
applied (the outputs validating are the check that the masks were fresh).
With speculative decoding, drafts on constrained rows sample under the masks of
the grammar advanced through them: seeded outputs equal the unspeculated ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine import scheduler as scheduler_module
from jaxserve.engine.config import CompileConfig, SpeculativeConfig
from jaxserve.engine.grammar import GrammarError
from jaxserve.model.loader import load_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker import InProcessWorker
from jaxserve.worker.executables import variant_name
from jaxserve.worker.sampler import MASKED, MASKED_SAMPLED
from tests.model.hf_tiny import copy_tokenizer, make_tiny_model
from tests.worker.speculative_oracle import OracleProposer

SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"type": "boolean"}, "c": {"enum": ["x", "yz"]}},
          "required": ["a", "b", "c"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, demo_model_dir):
    directory = tmp_path_factory.mktemp("tiny_llama_structured")
    # The tokenizer's whole vocabulary: a grammar may allow only merged tokens
    # (a compact JSON object starts with the one token '{"').
    make_tiny_model("LlamaForCausalLM", directory, seed=3, vocab_size=49152)
    return copy_tokenizer(demo_model_dir, directory)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    config = EngineConfig(
        model=str(tiny_dir), max_model_len=96, seed=5, async_scheduling=True,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                  token_buckets=(1, 4, 16), request_buckets=(1, 2, 4)),
        cache=CacheConfig(block_size=4, num_kv_blocks=128),
        compile=CompileConfig(strict_recompile=True))
    worker = InProcessWorker(load_model(tiny_dir, "float32"), progress=False)
    core = EngineCore(config, worker)
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(str(tiny_dir))


def _run(engine, requests: dict[str, SamplingParams], prompt=(5, 9, 14, 3)):
    for rid, sp in requests.items():
        engine.check_structured_outputs(sp)
        engine.add_request(EngineCoreRequest(rid, list(prompt), sp))
    tokens, reasons = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            key = (out.request_id, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[key] = out.finish_reason
    return tokens, reasons


def _text(tokenizer, ids, eos=(2,)):
    return tokenizer.decode([t for t in ids if t not in eos])


def test_json_schema_outputs_parse_and_validate(engine, tokenizer):
    sp = SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=60,
                        structured_outputs={"json": SCHEMA})
    obj = SamplingParams(temperature=1.0, seed=8, max_tokens=60,
                         structured_outputs={"json_object": True})
    tokens, reasons = _run(engine, {"schema": sp, "object": obj})
    assert set(tokens) == {("schema", 0), ("schema", 1), ("object", 0)}
    for index in (0, 1):
        text = _text(tokenizer, tokens[("schema", index)])
        assert reasons[("schema", index)] == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    if reasons[("object", 0)] == "stop":  # any object may run past max_tokens
        assert isinstance(json.loads(_text(tokenizer, tokens[("object", 0)])), dict)
    assert tokens[("schema", 0)] != tokens[("schema", 1)]  # two sequences, two draws
    worker = engine.worker
    assert worker.executed_variants[variant_name(MASKED_SAMPLED)] > 0  # plain temperature
    assert worker.executed_variants[variant_name(MASKED)] == 0
    assert worker.guard.num_recompiles == 0


# Property values for the 20 schemas below: two of them per schema, every pair in turn.
VALUES = {
    "int": {"type": "integer", "minimum": -50, "maximum": 50},
    "bool": {"type": "boolean"},
    "enum": {"enum": ["red", "green", "blue"]},
    "str": {"type": "string", "maxLength": 6},
    "num": {"type": "number", "minimum": 0, "maximum": 10},
    "arr": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3},
    "obj": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                             "y": {"type": "boolean"}},
            "required": ["x", "y"], "additionalProperties": False},
}
SCHEMAS = [{"type": "object", "properties": {"a": VALUES[a], "b": VALUES[b]},
            "required": ["a", "b"] if i % 3 else ["a"], "additionalProperties": False}
           for i, (a, b) in enumerate(itertools.combinations(VALUES, 2))][:20]


def test_200_outputs_of_20_schemas_all_validate(engine, tokenizer):
    """Each schema 10 times (seeded, temperature 1.0): every output ends by its grammar
    ("stop"), parses and validates; a schema's outputs differ."""
    requests = {f"s{i}-{k}": SamplingParams(temperature=1.0, seed=100 * i + k, max_tokens=90,
                                            structured_outputs={"json": schema})
                for i, schema in enumerate(SCHEMAS) for k in range(10)}
    tokens, reasons = _run(engine, requests)
    assert len(tokens) == 200
    outputs: dict[int, set] = {}
    for (rid, _), ids in tokens.items():
        text = _text(tokenizer, ids)
        assert reasons[(rid, 0)] == "stop", text
        schema = int(rid[1:].split("-")[0])
        jsonschema.validate(json.loads(text), SCHEMAS[schema])
        outputs.setdefault(schema, set()).add(text)
    assert all(len(texts) > 1 for texts in outputs.values()), outputs


def test_regex_and_choice_outputs(engine, tokenizer):
    choices = ["yes", "no", "maybe so"]
    requests = {"regex": SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=20,
                                        structured_outputs={"regex": "[a-e]{2,6}-[0-9]{1,3}"}),
                "choice": SamplingParams(temperature=1.0, n=3, seed=2, max_tokens=20,
                                         structured_outputs={"choice": choices}),
                "lark": SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={
                    "grammar": 'start: "(" NUM ("+" NUM)? ")"\nNUM: /[0-9]/'})}
    tokens, reasons = _run(engine, requests)
    for i in range(3):
        assert re.fullmatch("[a-e]{2,6}-[0-9]{1,3}", _text(tokenizer, tokens[("regex", i)]))
        assert _text(tokenizer, tokens[("choice", i)]) in choices
        assert reasons[("choice", i)] == "stop"
    assert re.fullmatch(r"\([0-9](\+[0-9])?\)", _text(tokenizer, tokens[("lark", 0)]))


def test_unconstrained_neighbours_draw_the_same_tokens(engine):
    plain = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone, _ = _run(engine, {"plain": plain})
    mixed, _ = _run(engine, {"plain": plain, "json": SamplingParams(
        temperature=1.0, seed=3, max_tokens=30, structured_outputs={"json": SCHEMA})})
    assert mixed[("plain", 0)] == alone[("plain", 0)]


@pytest.mark.parametrize("so, field", [
    ({"json": {"type": "nonsense"}}, "json"),
    ({"regex": "a(b"}, "regex"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
])
def test_bad_constraint_is_refused_and_the_engine_keeps_serving(engine, so, field):
    sp = SamplingParams(max_tokens=5, structured_outputs=so)
    with pytest.raises(GrammarError) as info:
        engine.check_structured_outputs(sp)
    assert info.value.field == f"sampling_params.structured_outputs.{field}"
    # Queued without the check, it finishes (abort) without running; others are served.
    engine.add_request(EngineCoreRequest("bad", [5, 6], sp))
    tokens, reasons = _run(engine, {"good": SamplingParams(temperature=0.0, max_tokens=3,
                                                           ignore_eos=True)})
    assert reasons[("bad", 0)] == "abort" and tokens[("bad", 0)] == []
    assert reasons[("good", 0)] == "length" and len(tokens[("good", 0)]) == 3


def test_the_next_constrained_step_is_planned_while_one_runs(engine, monkeypatch):
    """Events of a constrained run: each step after the first is scheduled before the
    result of the step in flight is read, and submitted (with its masks) after it."""
    events = []
    schedule, submit = engine.scheduler.schedule, engine.worker.submit

    def scheduling():
        events.append(("schedule", None))
        return schedule()

    def submitting(plan):
        pending = submit(plan)
        events.append(("submit", plan.step_id))
        result = pending.result

        def reading():
            events.append(("result", plan.step_id))
            return result()

        monkeypatch.setattr(pending, "result", reading)
        return pending

    monkeypatch.setattr(engine.scheduler, "schedule", scheduling)
    monkeypatch.setattr(engine.worker, "submit", submitting)
    _run(engine, {"s": SamplingParams(temperature=1.0, seed=4, max_tokens=30,
                                      structured_outputs={"json": SCHEMA})})
    submits = [i for i, (kind, _) in enumerate(events) if kind == "submit"]
    assert len(submits) > 5
    for before, after in zip(submits, submits[1:]):
        step = events[before][1]
        read = events.index(("result", step))
        planned = max(i for i in range(before, after) if events[i][0] == "schedule")
        assert before < planned < read < after, events[before:after + 1]


def test_preempted_sequences_keep_their_matcher(tiny_dir, tokenizer):
    """A KV cache too small for every sequence at once: some are preempted and resume."""
    config = EngineConfig(
        model=str(tiny_dir), max_model_len=48, seed=9, async_scheduling=True,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                  token_buckets=(1, 4, 16), request_buckets=(1, 2, 4)),
        cache=CacheConfig(block_size=4, num_kv_blocks=13),  # 12 usable: one sequence's 48
        compile=CompileConfig(strict_recompile=True))
    worker = InProcessWorker(load_model(tiny_dir, "float32"), progress=False)
    engine = EngineCore(config, worker)
    try:
        sp = SamplingParams(temperature=1.0, n=4, seed=21, max_tokens=40,
                            structured_outputs={"json": SCHEMA})
        tokens, reasons = _run(engine, {"s": sp}, prompt=(5, 6, 7, 8))
        assert engine.scheduler.num_preemptions > 0
        for i in range(4):
            text = _text(tokenizer, tokens[("s", i)])
            assert reasons[("s", i)] == "stop", text
            jsonschema.validate(json.loads(text), SCHEMA)
        assert worker.guard.num_recompiles == 0
    finally:
        engine.shutdown()


def test_a_masked_steady_step_makes_one_upload_and_one_download(engine, monkeypatch):
    """The bitmask travels in the step's one upload (tests/worker/test_device_step.py's count)."""
    import jax

    from tests.worker.test_device_step import _Transfers

    long_regex = SamplingParams(temperature=1.0, seed=5, max_tokens=80,
                                structured_outputs={"regex": "[a-z]{1000}"})
    # Compiled before the count: a grammar still compiling (slow on a loaded machine)
    # would keep its rows waiting into the counted steps.
    engine.check_structured_outputs(long_regex)
    engine.add_request(EngineCoreRequest("m0", [5, 9, 14, 3], long_regex))
    engine.add_request(EngineCoreRequest("m1", [5, 9, 14, 3], dataclasses.replace(
        long_regex, seed=6)))
    engine.add_request(EngineCoreRequest("plain", [7, 8], SamplingParams(
        temperature=0.0, max_tokens=80, ignore_eos=True)))
    for _ in range(4):  # prefills and the first decode
        engine.step()
    transfers = _Transfers(monkeypatch)
    steps, tokens = 20, 0
    with jax.transfer_guard("disallow"):
        for _ in range(steps):
            tokens += sum(len(out.new_token_ids) for out in engine.step())
    assert tokens == 3 * steps
    assert transfers.uploads == steps and transfers.downloads == steps
    engine.abort_requests(["m0", "m1", "plain"])
    while engine.has_unfinished_requests():
        engine.step()


def test_drafts_on_constrained_rows_change_no_token(engine, tiny_dir, tokenizer, monkeypatch):
    """Speculative decoding: a constrained row keeps the drafts its grammar allows, and each
    draft slot samples under the grammar advanced through the drafts before it — so the
    seeded outputs are the unspeculated engine's, token for token (oracle drafts, a wrong
    one every third proposal, cut where the grammar refuses it)."""
    requests = {f"s{i}": SamplingParams(temperature=1.0, seed=300 + i, max_tokens=60,
                                        structured_outputs={"json": schema})
                for i, schema in enumerate([SCHEMA, *SCHEMAS[:7]])}
    requests["regex"] = SamplingParams(temperature=1.0, seed=9, max_tokens=30,
                                       structured_outputs={"regex": r"[a-c]{3}-\d{4}"})
    want, want_reasons = _run(engine, requests)
    prompt = [5, 9, 14, 3]
    oracle = OracleProposer([prompt + want[(rid, 0)] for rid in requests], 49152)
    monkeypatch.setattr(scheduler_module, "propose_ngram", oracle)
    config = dataclasses.replace(engine.config, speculative_config=SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2))
    spec = EngineCore(config, InProcessWorker(load_model(tiny_dir, "float32"), progress=False))
    try:
        got, reasons = {}, {}
        names = list(requests)
        for i in range(0, len(names), 2):  # two rows at a time: R = 4 leaves slots for drafts
            tokens, ends = _run(spec, {rid: requests[rid] for rid in names[i:i + 2]})
            got.update(tokens)
            reasons.update(ends)
        assert got == want and reasons == want_reasons
        stats = spec.stats()
        assert stats.spec_decode_num_accepted_tokens > 20
        assert stats.spec_decode_num_draft_tokens < sum(oracle.proposals)  # cut by grammars
        assert spec.worker.guard.num_recompiles == 0
    finally:
        spec.shutdown()
    for rid in requests:
        if rid != "regex":
            jsonschema.validate(json.loads(_text(tokenizer, got[(rid, 0)])),
                                requests[rid].structured_outputs.json)
