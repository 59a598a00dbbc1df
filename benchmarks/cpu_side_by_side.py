"""CPU side by side: jaxserve, transformers, vLLM and llama.cpp on the same workloads, one run.

Run: ``jaxserve bench cpu_side_by_side [--skip-hf] [--vllm-python PATH]``
(or ``python -m benchmarks.cpu_side_by_side``).

Workloads, float32, greedy, ``ignore_eos`` (every engine generates exactly
the asked number of tokens):

- ``batch1``: 1 request, 31-token prompt, 128 new tokens;
- ``batch16``: 16 requests × (32-token prompt, 128 new);
- ``batch64``: 64 requests × (32-token prompt, 64 new)
  (``--batch-sizes``, ``--prompt-lens``, ``--output-lens`` change these three);
- ``mix``: the ShareGPT-like mix of ``offline_throughput``'s defaults
  (16 requests, prompts 32–512, outputs 32–128; ``--mix-*``);
- ``prefill512``: one 512-token prompt, 1 new token (``--prefill-len``):
  its rate is *prompt* tokens/s, its time the time to first token.

Legs, each loading its engine once for all its workloads, warming up on
each workload (same prompt lengths, other tokens, 2 new tokens), then
timing it: jaxserve (one ``jaxserve.LLM``); transformers (``model.generate``,
one static batch per fixed-length workload, ``--hf-batch-size`` for the mix;
batches above ``--hf-max-batch`` and the mix only with ``--hf-all``: it is
slow; ``--skip-hf``); vLLM when ``--vllm-python`` is given or ``vllm`` is
importable (one runner process for all workloads, ``benchmarks.vllm_leg``);
llama.cpp when ``llama_cpp`` is importable and an F32 GGUF exists (batch 1
only, ``benchmarks.llama_cpp_leg``).

Batch-1 roofline: a decode step at batch 1 streams the weights once
(``decode_roofline.weight_bytes``); the memory bandwidth is measured in this
run before and after jaxserve's leg (``decode_roofline.measure_bandwidth``,
the best of both). Floor = bandwidth / weight bytes (tokens/s); each leg's
ratio = its batch-1 output tokens/s / floor (1.0 = at the roofline; the
batch-1 run includes its 31-token prefill).

``--quantized`` adds four batch-1 legs: jaxserve with ``quantization="int8"``
(``jaxserve_int8``) and ``"int4"`` (``jaxserve_int4``), and llama.cpp on a Q8_0
and a Q4_0 GGUF made from the F32 one by llama.cpp's own quantizer
(``llama_cpp_q8_0``, ``llama_cpp_q4_0``, ``llama_cpp_leg.quantized_gguf``).
Each has its own floor: bandwidth / the bytes of its quantized weights a
token reads (``decode_roofline.weight_bytes(quantization=...)``: int8 / int4
kernels plus float32 scales; ``llama_cpp_leg.gguf_decode_bytes``: the GGUF's
blocks as stored), reported in ``roofline["floors"]``.

Printed: a table, rows = workloads, columns = each engine's tokens/s and
jaxserve's ratio to vLLM and to transformers (> 1: jaxserve is faster), the
roofline, the engines' start-up seconds (jaxserve's ``LLM`` construction,
vLLM's ``load_seconds``) and the load average before and after. Writes
``<results>/cpu_side_by_side.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any

from benchmarks import common, llama_cpp_leg, vllm_leg
from benchmarks.jaxserve_leg import add_arguments as jaxserve_leg_arguments
from benchmarks.dataset import Workload, fixed_lengths, sharegpt_like

logger = logging.getLogger(__name__)

NAME = "cpu_side_by_side"
DTYPE = "float32"
ENGINES = ("jaxserve", "transformers", "vllm", "llama_cpp")
# --quantized, batch 1 only: jaxserve's method and the llama.cpp type it is compared with.
QUANTIZED_PAIRS = (("int8", "Q8_0"), ("int4", "Q4_0"))
QUANTIZED_ENGINES = tuple(e for method, kind in QUANTIZED_PAIRS
                          for e in (f"jaxserve_{method}", f"llama_cpp_{kind.lower()}"))
ENGINE_LABELS = {"jaxserve": "jaxserve", "transformers": "transformers", "vllm": "vLLM",
                 "llama_cpp": "llama.cpp",
                 **{f"jaxserve_{m}": f"jaxserve {m}" for m, _ in QUANTIZED_PAIRS},
                 **{f"llama_cpp_{k.lower()}": f"llama.cpp {k}" for _, k in QUANTIZED_PAIRS}}


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One workload of the side by side.

    ``rate``: ``"output"`` (output tokens/s) or ``"prompt"`` (prompt tokens/s,
    the prefill case). ``hf``: whether transformers runs it by default.
    """

    name: str
    label: str
    workload: Workload
    rate: str = "output"
    hf: bool = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    jaxserve_leg_arguments(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64],
                        help="requests of each fixed-length workload (default 1 16 64)")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[31, 32, 32],
                        help="their prompt lengths in tokens (default 31 32 32)")
    parser.add_argument("--output-lens", type=int, nargs="+", default=[128, 128, 64],
                        help="their output lengths in tokens (default 128 128 64)")
    parser.add_argument("--mix-requests", type=int, default=16,
                        help="requests of the ShareGPT-like mix (default 16; 0: no mix)")
    parser.add_argument("--mix-input-range", type=int, nargs=2, default=(32, 512),
                        metavar=("MIN", "MAX"), help="the mix's prompt lengths (default 32 512)")
    parser.add_argument("--mix-output-range", type=int, nargs=2, default=(32, 128),
                        metavar=("MIN", "MAX"), help="the mix's output lengths (default 32 128)")
    parser.add_argument("--prefill-len", type=int, default=512,
                        help="prompt tokens of the prefill case (default 512; 0: none)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--skip-hf", action="store_true", help="no transformers leg")
    parser.add_argument("--hf-all", action="store_true",
                        help="transformers runs every workload (default: batches up to "
                             "--hf-max-batch and the prefill; not the mix)")
    parser.add_argument("--hf-max-batch", type=int, default=16,
                        help="largest fixed-length batch transformers runs without --hf-all "
                             "(default 16)")
    parser.add_argument("--hf-batch-size", type=int, default=16,
                        help="transformers' static batch size on the mix (default 16)")
    vllm_leg.add_arguments(parser)
    parser.add_argument("--gguf", default=None,
                        help="F32 GGUF for the llama.cpp leg (default: an F32 *.gguf in the "
                             "demo model's cache, demo model only)")
    parser.add_argument("--quantized", action="store_true",
                        help="also run batch 1 with jaxserve int8 and llama.cpp Q8_0, each "
                             "with its own bandwidth floor")
    parser.add_argument("--bandwidth-mib", type=int, default=512,
                        help="size of the array the bandwidth probe streams (default 512 MiB)")
    parser.add_argument("--bandwidth-reps", type=int, default=10)


def make_cases(args: argparse.Namespace, vocab_size: int) -> list[Case]:
    """The workloads (module docstring), each fixed-length one with its own seed.

    Raises:
      SystemExit: ``--batch-sizes``, ``--prompt-lens``, ``--output-lens`` differ in length.
    """
    if not len(args.batch_sizes) == len(args.prompt_lens) == len(args.output_lens):
        raise SystemExit("--batch-sizes, --prompt-lens and --output-lens need one value each "
                         f"per workload, got {args.batch_sizes}, {args.prompt_lens}, "
                         f"{args.output_lens}")
    cases = []
    for i, (n, prompt, out) in enumerate(zip(args.batch_sizes, args.prompt_lens,
                                             args.output_lens)):
        cases.append(Case(f"batch{n}", f"{n} x ({prompt} in, {out} out)",
                          fixed_lengths(n, vocab_size, prompt, out, seed=args.seed + 1 + i),
                          hf=args.hf_all or n <= args.hf_max_batch))
    if args.mix_requests > 0:
        mix = sharegpt_like(args.mix_requests, vocab_size, seed=args.seed,
                            input_range=tuple(args.mix_input_range),
                            output_range=tuple(args.mix_output_range))
        cases.append(Case("mix", f"{len(mix)} req ({mix.num_prompt_tokens} in, "
                                 f"{mix.num_output_tokens} out)", mix, hf=args.hf_all))
    if args.prefill_len > 0:
        cases.append(Case(f"prefill{args.prefill_len}", f"1 x ({args.prefill_len} in, 1 out)",
                          fixed_lengths(1, vocab_size, args.prefill_len, 1,
                                        seed=args.seed + 100), rate="prompt"))
    return cases


def tokens_per_s(case: Case, leg: dict[str, Any]) -> float | None:
    """The case's rate for one leg's result: output or prompt tokens/s; None on error."""
    if "error" in leg:
        return None
    if case.rate == "prompt":
        return case.workload.num_prompt_tokens / leg["elapsed"]
    return leg["output_tokens"] / leg["elapsed"]


def _bandwidth(args: argparse.Namespace) -> dict[str, float]:
    from benchmarks import decode_roofline

    logger.info("measuring memory bandwidth (%d MiB)", args.bandwidth_mib)
    return decode_roofline.measure_bandwidth(args.bandwidth_mib, args.bandwidth_reps)


def run_legs(args: argparse.Namespace, cases: list[Case], model_dir: str
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs every leg; returns (legs, bandwidth).

    legs: ``{engine: {"load_seconds", "workloads": {case: result}}}`` or
    ``{engine: {"error": why}}``. bandwidth: the probe's ``{"before", "after"}``
    (``measure_bandwidth`` dicts, GB/s; None without a ``batch1`` case).
    """
    from benchmarks import jaxserve_leg

    workloads = {c.name: c.workload for c in cases}
    roofline = any(c.name == "batch1" for c in cases)
    before = _bandwidth(args) if roofline else None
    options = jaxserve_leg.EngineOptions(max_num_seqs=args.max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         dtype=DTYPE, attention_backend=args.attention_backend)
    legs: dict[str, Any] = {"jaxserve": jaxserve_leg.run_workloads(
        workloads, model=model_dir, tokenizer=args.tokenizer, options=options, seed=args.seed)}
    legs["jaxserve"]["engine_options"] = options.as_dict()
    after = _bandwidth(args) if roofline else None

    hf_cases = [c for c in cases if c.hf]
    if args.skip_hf:
        legs["transformers"] = {"error": "skipped (--skip-hf)"}
    elif not hf_cases:
        legs["transformers"] = {"error": "no workload within --hf-max-batch (see --hf-all)"}
    else:
        from benchmarks import hf_leg

        model, pad_id, load = hf_leg.load(model_dir, dtype=DTYPE)
        legs["transformers"] = {"load_seconds": load, "workloads": {
            c.name: hf_leg.generate(model, pad_id, c.workload,
                                    batch_size=args.hf_batch_size if c.name == "mix"
                                    else len(c.workload))
            for c in hf_cases}}
        del model

    python = vllm_leg.find_python(args.vllm_python)
    if python is None:
        legs["vllm"] = {"error": "vllm is not importable here and no --vllm-python was given"}
    else:
        legs["vllm"] = vllm_leg.run_workloads(
            workloads, model_dir=model_dir, python=python, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, dtype=DTYPE,
            memory_fraction=args.vllm_memory_fraction)

    batch1 = next((c for c in cases if c.name == "batch1"), None)
    if batch1 is None:
        gguf, why = None, "no batch1 workload (it runs batch 1 only)"
    elif args.gguf is None and args.model is not None:
        gguf, why = None, "--model is not the demo model: give its F32 GGUF with --gguf"
    else:
        gguf, why = llama_cpp_leg.available(args.gguf)
    legs["llama_cpp"] = _llama_cpp(batch1, gguf, why)
    if getattr(args, "quantized", False):
        legs.update(_quantized_legs(args, batch1, model_dir, gguf, why))
    return legs, {"before": before, "after": after}


def _llama_cpp(batch1: Case | None, gguf, why: str) -> dict[str, Any]:
    """One llama.cpp leg on ``gguf`` (batch 1), or ``{"error": why}``."""
    if gguf is None:
        return {"error": why}
    try:
        result = llama_cpp_leg.run(batch1.workload, gguf=gguf)
        return {"load_seconds": result.pop("load_seconds"), "workloads": {"batch1": result}}
    except Exception as err:  # a failed leg is reported, the others still count
        logger.exception("llama.cpp leg failed")
        return {"error": f"{type(err).__name__}: {err}"}


def _quantized_legs(args: argparse.Namespace, batch1: Case | None, model_dir: str, f32_gguf,
                    why: str) -> dict[str, Any]:
    """The ``--quantized`` legs: jaxserve int8 / int4 and llama.cpp Q8_0 / Q4_0, batch 1 each."""
    from benchmarks import jaxserve_leg

    if batch1 is None:
        return {e: {"error": "no batch1 workload (it runs batch 1 only)"}
                for e in QUANTIZED_ENGINES}
    legs: dict[str, Any] = {}
    for method, kind in QUANTIZED_PAIRS:
        options = jaxserve_leg.EngineOptions(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            dtype=DTYPE, attention_backend=args.attention_backend, quantization=method)
        legs[f"jaxserve_{method}"] = jaxserve_leg.run_workloads(
            {"batch1": batch1.workload}, model=model_dir, tokenizer=args.tokenizer,
            options=options, seed=args.seed)
        legs[f"jaxserve_{method}"]["engine_options"] = options.as_dict()
        gguf, gguf_why = ((None, why) if f32_gguf is None
                          else llama_cpp_leg.quantized_gguf(f32_gguf, kind))
        engine = f"llama_cpp_{kind.lower()}"
        legs[engine] = _llama_cpp(batch1, gguf, gguf_why)
        if gguf is not None:
            legs[engine]["decode_bytes"] = llama_cpp_leg.gguf_decode_bytes(gguf)
    return legs


def engines(legs: dict[str, Any]) -> tuple[str, ...]:
    """The engines of a run: ``ENGINES``, then the ``--quantized`` ones when they ran."""
    return ENGINES + tuple(e for e in QUANTIZED_ENGINES if e in legs)


def summarize(cases: list[Case], legs: dict[str, Any], bandwidth: dict[str, Any],
              model_dir: str) -> dict[str, Any]:
    """The table (tokens/s and ratios per case), the roofline and the start-up seconds.

    With the ``--quantized`` legs, ``roofline["floors"]`` holds each engine's
    ``{"decode_bytes", "floor_tokens_per_s"}`` and its ratio is against its own floor.
    """
    table: dict[str, Any] = {}
    names = engines(legs)
    for case in cases:
        row: dict[str, Any] = {"label": case.label, "rate": f"{case.rate} tokens/s"}
        for engine in names:
            leg = legs.get(engine, {})
            result = leg.get("workloads", {}).get(case.name)
            row[engine] = None if result is None else tokens_per_s(case, result)
        for other in ("vllm", "transformers"):
            row[f"jaxserve_over_{other}"] = (row["jaxserve"] / row[other]
                                             if row["jaxserve"] and row[other] else None)
        table[case.name] = row
    roofline = None
    if bandwidth["before"] is not None:
        from benchmarks import decode_roofline

        weights = decode_roofline.weight_bytes(model_dir, itemsize=4)  # float32
        best = max(bandwidth["before"]["best_gb_s"], bandwidth["after"]["best_gb_s"])
        floor = best * 1e9 / weights["decode_bytes"]
        floors = {e: floor for e in ENGINES}
        roofline = {"weights": weights, "bandwidth": {**bandwidth, "best_gb_s": best},
                    "floor_tokens_per_s": floor}
        if len(names) > len(ENGINES):
            per_engine = {e: weights["decode_bytes"] for e in ENGINES}
            for method, kind in QUANTIZED_PAIRS:
                per_engine[f"jaxserve_{method}"] = decode_roofline.weight_bytes(
                    model_dir, itemsize=4, quantization=method)["decode_bytes"]
                per_engine[f"llama_cpp_{kind.lower()}"] = legs.get(
                    f"llama_cpp_{kind.lower()}", {}).get("decode_bytes")
            floors = {e: best * 1e9 / n if n else None for e, n in per_engine.items()}
            roofline["floors"] = {e: {"decode_bytes": per_engine[e],
                                      "floor_tokens_per_s": floors[e]} for e in names}
        roofline["ratio"] = {e: (table["batch1"][e] / floors[e]
                                 if table["batch1"][e] and floors[e] else None) for e in names}
    startup = {e: legs[e]["load_seconds"] for e in names
               if e in legs and "load_seconds" in legs[e]}
    return {"table": table, "roofline": roofline, "startup_seconds": startup}


def run(args: argparse.Namespace) -> dict[str, Any]:
    common.use_compilation_cache()  # before jax starts its backend
    from benchmarks.offline_throughput import vocab_size

    model_dir = str(common.resolve_model(args.model))
    cases = make_cases(args, vocab_size(model_dir))
    load_before = common.load_average()
    legs, bandwidth = run_legs(args, cases, model_dir)
    load_after = common.load_average()
    summary = summarize(cases, legs, bandwidth, model_dir)
    return {"benchmark": NAME, "args": vars(args), "environment": common.environment(),
            "dtype": DTYPE, "load_average_before": load_before,
            "load_average_after": load_after,
            "workloads": {c.name: {"label": c.label, "rate": c.rate, **c.workload.summary()}
                          for c in cases},
            "legs": legs, **summary}


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(result: dict[str, Any]) -> str:
    """The table printed at the end (module docstring)."""
    names = engines(result["legs"])
    w = 16 if len(names) > len(ENGINES) else 13  # the default run's table as it was
    header = (f"{'workload':34s}" + "".join(f"{ENGINE_LABELS[e]:>{w}s}" for e in names)
              + f"{'jax/vLLM':>10s}{'jax/HF':>8s}")
    lines = [f"CPU side by side, {result['dtype']}, greedy; tokens/s "
             "(prefill: prompt tokens/s, else output tokens/s)",
             f"load average before {result['load_average_before']}, "
             f"after {result['load_average_after']}", header]
    for name, row in result["table"].items():
        lines.append(f"{name + ' ' + row['label']:34s}"
                     + "".join(f"{_cell(row[e], '.1f'):>{w}s}" for e in names)
                     + f"{_cell(row['jaxserve_over_vllm'], '.2f'):>10s}"
                     + f"{_cell(row['jaxserve_over_transformers'], '.2f'):>8s}")
    roof = result["roofline"]
    if roof is not None:
        b = roof["bandwidth"]
        lines.append(
            f"batch-1 roofline: {roof['weights']['decode_bytes'] / 1e6:.1f} MB of weights a "
            f"token, bandwidth {b['best_gb_s']:.1f} GB/s (best of before "
            f"{b['before']['best_gb_s']:.1f} / after {b['after']['best_gb_s']:.1f}) -> floor "
            f"{roof['floor_tokens_per_s']:.1f} tok/s; measured / floor: "
            + ", ".join(f"{ENGINE_LABELS[e]} {_cell(r, '.2f')}" for e, r in roof["ratio"].items()))
        for e, f in roof.get("floors", {}).items():
            mb = f["decode_bytes"] / 1e6 if f["decode_bytes"] else None
            lines.append(f"  {ENGINE_LABELS[e]}: {_cell(mb, '.1f')} MB a token -> floor {_cell(f['floor_tokens_per_s'], '.1f')} tok/s, "
                         f"measured / floor {_cell(roof['ratio'][e], '.2f')}")
    cache = result["legs"]["jaxserve"].get("load_cache", {})
    warm = ("warm compilation cache" if cache.get("cache_misses") == 0 else
            f"compilation cache: {cache.get('cache_hits')} hits, "
            f"{cache.get('cache_misses')} compiled")
    lines.append("start-up s: " + ", ".join(
        f"{ENGINE_LABELS[e]} {s:.1f}" + (f" ({warm})" if e == "jaxserve" else "")
        for e, s in result["startup_seconds"].items()))
    for engine in names:
        leg = result["legs"].get(engine, {})
        if "error" in leg:
            lines.append(f"{ENGINE_LABELS[engine]} not run: {leg['error']}")
        for name, r in leg.get("workloads", {}).items():
            if "error" in r:
                lines.append(f"{ENGINE_LABELS[engine]} {name}: {r['error']}")
            elif r.get("compiles"):
                lines.append(f"{ENGINE_LABELS[engine]} {name}: {r['compiles']} compiles in the "
                             "timed window")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, result, path = common.run_cli(NAME, __doc__, add_arguments, run, argv)
    print(report(result))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
