"""Structured outputs: decode tokens/s of a batch with half its rows JSON-schema constrained.

Run: ``jaxserve bench structured_outputs [--model DIR] [--max-tokens N]`` (default:
the demo model, batch 16, 64 tokens; a few minutes on the 2-core CPU).

On one ``jaxserve.LLM``, the same B chat prompts (B = ``--batch``), the same
``max_tokens``, temperature 1.0, seed ``--seed + i`` for row i, nothing
ignored (no ``ignore_eos``: a constrained row ends where its grammar does):

- (a) **unconstrained**: every row free;
- (b) **half constrained**: even rows carry ``StructuredOutputsParams(json=...)``,
  cycling through ``SCHEMAS`` (nested objects, arrays, enums, numbers,
  required fields, ``additionalProperties: false``); odd rows free;
- (c) **unconstrained, matched lengths**: every row free, row i generating
  exactly as many tokens as row i of the (b) run just before it
  (``max_tokens`` = that length, ``ignore_eos``): the same work step for step
  as (b) — the same rows in the same steps, the batch thinning as (b)'s
  constrained rows end — without the constraints.

Output tokens/s = generated tokens (all rows) / wall time of ``generate``
(prefill included), the median of ``--repeats`` runs of each, alternated;
``ratio`` = (b) / (a) (the project's target: >= 0.9). (a) and (b) generate
different token counts (a constrained row ends with its JSON while a free row
runs on), which lowers (b)'s tokens/s whatever a constrained step costs;
``ratio_matched`` = (b) / (c) compares equal work, so it is the cost of the
constraints alone (grammar, mask, masked sampler, no run-ahead). Also
reported: steps and ms per step. Warm-up first: (a) and (b) once with few
tokens, (b) once whole (its row lengths make (c); the seeds fix them), then
(c) with few tokens, then the worker's background compiles (the masked
sampler variants), so compiles in the timed window are counted and should be 0.

Grammar compile time of each schema, on the engine's ``GrammarCompiler``:
``first`` (a ``json_object`` compile runs before, so the llguidance tokenizer
build is not in it; that one is reported as ``tokenizer_and_json_object``)
and ``cached`` (the same schema again: an LRU hit). Every constrained output
is parsed and validated with ``jsonschema``; the counts are reported (an
output cut by ``max_tokens``, finish "length", need not parse).
Writes ``<results>/structured_outputs.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from typing import Any

from benchmarks import common
from benchmarks.compile_watch import CompileCounter

logger = logging.getLogger(__name__)

NAME = "structured_outputs"

SCHEMAS: dict[str, dict[str, Any]] = {
    "user": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 32},
            "role": {"enum": ["admin", "editor", "viewer"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "items": {"type": "array", "maxItems": 3, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 8},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"], "additionalProperties": False}},
            "total": {"type": "number"},
        },
        "required": ["id", "items", "total"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
            "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            "wind": {"type": "object", "properties": {
                "speed_kmh": {"type": "number"}, "direction": {"enum": ["N", "E", "S", "W"]}},
                "required": ["speed_kmh", "direction"], "additionalProperties": False},
        },
        "required": ["city", "temperature_c", "conditions", "wind"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                     "maxItems": 3},
            "recommend": {"type": "boolean"},
        },
        "required": ["rating", "recommend"],
        "additionalProperties": False,
    },
}
TASKS = ("Describe a user of a web app as JSON.", "Write a shop order as JSON.",
         "Give today's weather in a city as JSON.", "Review a book you liked as JSON.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument("--batch", type=int, default=16, help="rows per batch (default 16)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="max_tokens of every row (default 64)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each batch; the median is reported (default 3)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)


def prompts(tokenizer, batch: int, vocab_size: int) -> list[list[int]]:
    """B chat-templated prompts (token ids), the four tasks in turn.

    Ids at or above the model's ``vocab_size`` (tests' tiny models under the demo
    tokenizer) are taken modulo it; the demo model's are all below it.
    """
    out = []
    for i in range(batch):
        messages = [{"role": "user", "content": TASKS[i % len(TASKS)]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        out.append([t % vocab_size for t in tokenizer.encode(text, add_special_tokens=False)])
    return out


def sampling_params(batch: int, max_tokens: int, seed: int, constrained: bool) -> list:
    """One SamplingParams per row; ``constrained``: even rows get a schema in turn."""
    from jaxserve import SamplingParams
    from jaxserve.structured_outputs import StructuredOutputsParams

    names = list(SCHEMAS)
    out = []
    for i in range(batch):
        so = None
        if constrained and i % 2 == 0:
            so = StructuredOutputsParams(json=SCHEMAS[names[(i // 2) % len(names)]])
        out.append(SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + i,
                                  structured_outputs=so))
    return out


def matched_params(params: list, outputs: list) -> list:
    """(c)'s rows: (b)'s ``params`` unconstrained, each generating exactly as many tokens
    as its row of ``outputs`` did (``max_tokens`` = that length, ``ignore_eos``)."""
    return [dataclasses.replace(p, structured_outputs=None, ignore_eos=True,
                                max_tokens=max(1, len(o.outputs[0].token_ids)))
            for p, o in zip(params, outputs)]


def compile_times(grammars) -> dict[str, Any]:
    """Seconds of each schema's first and cached compile on the engine's compiler."""
    from jaxserve.structured_outputs import StructuredOutputsParams

    def timed(params) -> float:
        start = time.perf_counter()
        grammars.submit(params).result()
        return time.perf_counter() - start

    out: dict[str, Any] = {
        "tokenizer_and_json_object": timed(StructuredOutputsParams(json_object=True))}
    for name, schema in SCHEMAS.items():
        params = StructuredOutputsParams(json=schema)
        out[name] = {"first": timed(params), "cached": timed(params)}
    return out


def validate(outputs, params) -> dict[str, int]:
    """Counts of the constrained outputs: all, finished by the grammar, parsed, valid."""
    import jsonschema

    counts = {"constrained": 0, "stop": 0, "length": 0, "abort": 0, "parsed": 0, "valid": 0}
    for out, sp in zip(outputs, params):
        if sp.structured_outputs is None:
            continue
        completion = out.outputs[0]
        counts["constrained"] += 1
        counts[completion.finish_reason] = counts.get(completion.finish_reason, 0) + 1
        try:
            value = json.loads(completion.text)
        except ValueError:
            continue
        counts["parsed"] += 1
        try:
            jsonschema.validate(value, sp.structured_outputs.json)
            counts["valid"] += 1
        except jsonschema.ValidationError:
            pass
    return counts


def timed_run(llm, prompt_ids, params) -> tuple[dict[str, Any], list]:
    engine = llm.engine
    steps0 = engine.num_steps
    compiles = CompileCounter()
    with compiles.watch():
        start = time.perf_counter()
        outputs = llm.generate(prompt_ids, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = engine.num_steps - steps0
    return {"elapsed": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "steps": steps, "ms_per_step": 1e3 * elapsed / max(steps, 1),
            **compiles.as_dict()}, outputs


def run(args: argparse.Namespace) -> dict[str, Any]:
    common.use_compilation_cache()
    from jaxserve import LLM

    model_dir = str(common.resolve_model(args.model))
    result: dict[str, Any] = {"args": vars(args), "load_average_before": common.load_average()}
    with LLM(model_dir, tokenizer=args.tokenizer, max_num_seqs=args.batch,
             max_num_batched_tokens=args.max_num_batched_tokens) as llm:
        result["grammar_compile_s"] = compile_times(llm.engine.grammars)
        prompt_ids = prompts(llm.get_tokenizer(), args.batch, llm.engine.geometry.vocab_size)
        legs = {"unconstrained": sampling_params(args.batch, args.max_tokens, args.seed, False),
                "half_constrained": sampling_params(args.batch, args.max_tokens, args.seed, True)}
        for params in legs.values():  # warm-up: both batches, a few tokens
            llm.generate(prompt_ids, [dataclasses.replace(p, max_tokens=4) for p in params],
                         use_tqdm=False)
        whole = llm.generate(prompt_ids, legs["half_constrained"], use_tqdm=False)
        legs["unconstrained_matched"] = matched_params(legs["half_constrained"], whole)
        llm.generate(prompt_ids, [dataclasses.replace(p, max_tokens=min(p.max_tokens, 4))
                                  for p in legs["unconstrained_matched"]], use_tqdm=False)
        background = getattr(llm.engine.worker, "background_compile", None)
        if background is not None:  # the masked variants; their compiles would share the cores
            background.join()
        runs: dict[str, list] = {name: [] for name in legs}
        for _ in range(args.repeats):
            for name, params in legs.items():
                stats, outputs = timed_run(llm, prompt_ids, params)
                runs[name].append(stats)
                if name == "half_constrained":
                    result.setdefault("validation", []).append(validate(outputs, params))
                    result["sample_outputs"] = [o.outputs[0].text for o in outputs[:4]]
                    legs["unconstrained_matched"] = matched_params(params, outputs)
        result["runs"] = runs
    median = {name: statistics.median(r["output_tokens_per_s"] for r in rs)
              for name, rs in runs.items()}
    result["output_tokens_per_s"] = median
    result["ratio"] = median["half_constrained"] / median["unconstrained"]
    result["ratio_matched"] = median["half_constrained"] / median["unconstrained_matched"]
    result["load_average_after"] = common.load_average()
    result["environment"] = common.environment()
    return result


def main(argv=None) -> int:
    _, result, path = common.run_cli(NAME, __doc__, add_arguments, run, argv)
    print(f"{'batch':18} {'out tok/s (median)':>19} {'tokens':>7} {'steps':>6} {'ms/step':>8}")
    for name, rs in result["runs"].items():
        print(f"{name:18} {result['output_tokens_per_s'][name]:19.1f} "
              f"{statistics.median(r['output_tokens'] for r in rs):7.0f} "
              f"{statistics.median(r['steps'] for r in rs):6.0f} "
              f"{statistics.median(r['ms_per_step'] for r in rs):8.1f}")
    print(f"ratio half_constrained / unconstrained: {result['ratio']:.3f} (target >= 0.9); "
          f"/ unconstrained_matched: {result['ratio_matched']:.3f}")
    if result["ratio_matched"] > 1.05:
        print("note: the matched batch, the same work without constraints, ran slower than the "
              "constrained one: the machine was busy (load average "
              f"{result['load_average_after']}); rerun with more --repeats on an idle machine")
    for name, t in result["grammar_compile_s"].items():
        print(f"compile {name}: {t}")
    print(f"validation: {result['validation']}; written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
