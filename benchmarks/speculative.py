"""Speculative decoding: batch-1 output tokens/s with and without, per proposer.

Run: ``jaxserve bench speculative [--model DIR] [--max-tokens N] [--num-speculative-tokens K]
[--draft-model DIR|self]`` (default: the demo model, 128 tokens, k = 3, prompt lookup 2..4,
no draft model; a few minutes on the 2-core CPU).

``jaxserve.LLM`` engines on the same model in one process — one plain, one with
``speculative_config={"method": "ngram", ...}`` and, with ``--draft-model``, one
with ``{"model": DIR, ...}`` (``self``: the model drafting for itself, whose
drafts the target accepts almost always: what a verifying step and the draft
model's k one-token steps cost, against a plain step) — run the same prompts
one at a time (batch 1), alternating between the engines every repeat, so all
see the same machine. Three workloads of chat prompts:

- **copy** (greedy): the answer copies a text given in the prompt — repeat a
  paragraph, fix a typo in one, rename a variable in a function, quote the key
  sentence (what prompt lookup is for: edits, refactors, retrieval-grounded
  answers);
- **open** (greedy): open-ended prompts with nothing to copy from the prompt
  (a small model still repeats its own phrases, which the proposer finds);
- **noisy**: the open prompts sampled at temperature 1.5 (seeded): text that
  rarely repeats, so most steps find no n-gram and run without drafts — the
  cost of speculation when it has nothing to offer.

Per workload and speculative engine (``ngram``, ``draft_model``): output
tokens/s = generated tokens / wall time of the ``generate`` calls (prefill
included), median of ``--repeats``; ``speedup`` = with / without (the
project's targets for ngram: >= 1.5 on copy, >= 0.95 on open); the acceptance rate
(drafts accepted / drafts verified) and the mean accepted length (tokens a
verifying step emits: 1 + accepted / verifying sequences), from the engine's
``EngineStats``; steps per output token and ms per step (wall time / steps,
prefill included: what a verifying step costs against a plain one); compiles in the timed window (should be
0); and whether every greedy output is token for token the plain engine's
(``identical``, which must hold — for the seeded workload too: a seeded
row's draw depends only on its seed and position). Writes ``<results>/speculative.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks import common
from benchmarks.compile_watch import CompileCounter

NAME = "speculative"

_PARAGRAPH = (
    "The paged KV cache stores the keys and values of every sequence in fixed-size blocks. "
    "A block table maps each sequence's logical blocks to physical ones, so sequences grow "
    "without copying, share common prefixes, and free their memory the moment they finish.")
_FUNCTION = (
    "def total_price(items, tax):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    "        subtotal += item.price * item.quantity\n"
    "    return subtotal * (1 + tax)\n")
_OPEN = (
    "Write a short poem about the sea.",
    "What are three good habits for a healthy life?",
    "Tell me a story about a dragon who learns to cook.",
    "Explain why the sky is blue to a child.",
)
# name -> (prompts, temperature); temperature > 0 runs seeded
WORKLOADS: dict[str, tuple[tuple[str, ...], float]] = {
    "copy": ((
        f"Repeat the following paragraph exactly.\n\n{_PARAGRAPH}",
        f"Fix the typo in this paragraph and write it out in full.\n\n"
        f"{_PARAGRAPH.replace('without copying', 'withuot copying')}",
        f"Rename the variable subtotal to running_total in this function and write the "
        f"whole function.\n\n{_FUNCTION}",
        f"Quote the sentence about the block table from this text, word for word.\n\n"
        f"{_PARAGRAPH}",
    ), 0.0),
    "open": (_OPEN, 0.0),
    "noisy": (_OPEN, 1.5),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="max_tokens of every prompt (default 128)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed passes over each workload per engine; the median is "
                             "reported (default 2)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3,
                        help="k, drafts per step (default 3)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--draft-model", default=None, metavar="DIR",
                        help="also run a draft-model engine with this model ('self': the "
                             "target model itself)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated workloads (default {','.join(WORKLOADS)})")


def prompts(tokenizer, texts, vocab_size: int) -> list[list[int]]:
    """Chat-templated prompt ids (ids >= ``vocab_size``, for tests' tiny models, wrap)."""
    out = []
    for text in texts:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        out.append([t % vocab_size for t in tokenizer.encode(chat, add_special_tokens=False)])
    return out


def timed_pass(llm, prompt_ids, params) -> tuple[dict[str, Any], list[list[int]]]:
    """The prompts one at a time; tokens/s, steps, spec counters and compiles."""
    engine = llm.engine
    before, steps0 = engine.stats(), engine.num_steps
    compiles = CompileCounter()
    outputs, elapsed = [], 0.0
    with compiles.watch():
        for ids in prompt_ids:
            start = time.perf_counter()
            (out,) = llm.generate([ids], params, use_tqdm=False)
            elapsed += time.perf_counter() - start
            outputs.append(list(out.outputs[0].token_ids))
    after = engine.stats()
    tokens = sum(map(len, outputs))
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    steps = engine.num_steps - steps0
    return {"elapsed": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "steps": steps, "steps_per_token": steps / max(tokens, 1),
            "ms_per_step": 1e3 * elapsed / max(steps, 1),
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None,
            **compiles.as_dict()}, outputs


def run(args: argparse.Namespace) -> dict[str, Any]:
    common.use_compilation_cache()
    from jaxserve import LLM, SamplingParams

    model_dir = str(common.resolve_model(args.model))
    k = args.num_speculative_tokens
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": k,
                       "prompt_lookup_min": args.prompt_lookup_min,
                       "prompt_lookup_max": args.prompt_lookup_max}}
    if args.draft_model is not None:
        draft = model_dir if args.draft_model == "self" else args.draft_model
        specs["draft_model"] = {"method": "draft_model", "model": draft,
                                "num_speculative_tokens": k}
    result: dict[str, Any] = {"args": vars(args), "speculative_config": specs,
                              "load_average_before": common.load_average()}
    engines = {"plain": None, **specs}
    llms = {name: LLM(model_dir, tokenizer=args.tokenizer, max_num_seqs=4,
                      request_buckets=(1, 2, 4), speculative_config=spec)
            for name, spec in engines.items()}
    try:
        vocab = llms["plain"].engine.geometry.vocab_size
        tokenizer = llms["plain"].get_tokenizer()
        workloads = {w: prompts(tokenizer, WORKLOADS[w][0], vocab)
                     for w in args.workloads.split(",")}
        for llm in llms.values():  # warm-up: every workload once, then the background compiles
            for ids in workloads.values():
                llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
            background = getattr(llm.engine.worker, "background_compile", None)
            if background is not None:
                background.join()
        table: dict[str, Any] = {}
        for workload, ids in workloads.items():
            params = SamplingParams(temperature=WORKLOADS[workload][1], seed=args.seed,
                                    max_tokens=args.max_tokens)
            runs: dict[str, list] = {name: [] for name in llms}
            outputs: dict[str, list] = {}
            for _ in range(args.repeats):
                for name, llm in llms.items():
                    stats, outputs[name] = timed_pass(llm, ids, params)
                    runs[name].append(stats)
            median = {name: statistics.median(r["output_tokens_per_s"] for r in rs)
                      for name, rs in runs.items()}
            table[workload] = {
                "runs": runs, "output_tokens_per_s": median,
                "speedup": {name: median[name] / median["plain"] for name in specs},
                "ms_per_step": {name: statistics.median(r["ms_per_step"] for r in rs)
                                for name, rs in runs.items()},
                "acceptance_rate": {name: runs[name][-1]["acceptance_rate"] for name in specs},
                "mean_accepted_length": {name: runs[name][-1]["mean_accepted_length"]
                                         for name in specs},
                "identical": {name: outputs[name] == outputs["plain"] for name in specs},
                "sample_output": tokenizer.decode(outputs["ngram"][0])}
        result["workloads"] = table
    finally:
        for llm in llms.values():
            llm.shutdown()
    result["load_average_after"] = common.load_average()
    result["environment"] = common.environment()
    return result


def main(argv=None) -> int:
    _, result, path = common.run_cli(NAME, __doc__, add_arguments, run, argv)
    print(f"{'workload':9} {'method':12} {'tok/s':>8} {'plain':>8} {'speedup':>8} "
          f"{'accept':>7} {'mean len':>9} {'ms/step':>8} {'plain':>7} {'identical':>10}")
    for workload, row in result["workloads"].items():
        for name in row["speedup"]:
            rate = row["acceptance_rate"][name]
            length = row["mean_accepted_length"][name]
            print(f"{workload:9} {name:12} {row['output_tokens_per_s'][name]:8.1f} "
                  f"{row['output_tokens_per_s']['plain']:8.1f} {row['speedup'][name]:8.2f} "
                  f"{'-' if rate is None else f'{rate:.2f}':>7} "
                  f"{'-' if length is None else f'{length:.2f}':>9} "
                  f"{row['ms_per_step'][name]:8.1f} {row['ms_per_step']['plain']:7.1f} "
                  f"{str(row['identical'][name]):>10}")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
