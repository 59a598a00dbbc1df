"""Weight-only int8 and int4, and the fp8 KV cache, against float32: perplexity of a fixed
text and decode tokens/s, side by side in one run.

Run: ``python -m benchmarks.quantization [--model DIR] [--new-tokens N]`` (default: the
demo model; about four minutes on the 2-core CPU).

For each of float32, int8, int4 (``quantization="int8"`` / ``"int4"``,
``jaxserve.model.quantization``) and float32 weights over an fp8 KV cache
(``kv_cache_dtype="fp8"``, "float32+kv-fp8"; ``jaxserve.model.kv_cache``):

- **perplexity** of ``TEXT`` (a fixed English paragraph, ~250 tokens of the demo
  tokenizer): one prefill of the whole text through the worker's step body
  (``run_body_logits``, the served model code), ``exp(-mean log p(token_i |
  tokens_<i))`` over every token but the first. The delta method − float32 (also
  relative) is the quality cost of the quantization on this text.
- **decode tokens/s** at batch 1 and 16: ``jaxserve.LLM`` (greedy,
  ``ignore_eos``), after a warm-up generation and the worker's background
  compiles, times ``generate`` of B short prompts (8 tokens) × ``--new-tokens``
  tokens each, ``--repeats`` times; tokens/s = B × new tokens / the median wall
  time (prefill of the short prompts included). The machine is shared: quote
  the load average recorded in the JSON with the numbers.

Also reported, for each method against float32: the fraction of the text's positions
where the two models' most likely next token agrees (teacher-forced), how far the two
runs' greedy outputs of the largest batch agree (identical sequences, mean common
prefix), the speed-up, and the parameter bytes of each (quantized kernels + float32
scales against float32). Writes ``<results>/quantization.json``.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from typing import Any

from benchmarks import common

logger = logging.getLogger(__name__)

NAME = "quantization"
# (quantization, kv_cache_dtype) of each variant measured.
VARIANTS = ((None, "auto"), ("int8", "auto"), ("int4", "auto"), (None, "fp8"))


def variant_name(quantization: str | None, kv_cache_dtype: str) -> str:
    """"float32", "int8", "int4"; "+kv-fp8" appended for an fp8 KV cache."""
    return (quantization or "float32") + ("" if kv_cache_dtype == "auto" else "+kv-" + kv_cache_dtype)
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined a screw press, oil-based ink and movable metal type into a system "
    "that could produce books far faster than any scribe. Within a few decades print shops "
    "had opened in more than two hundred European cities. Books became cheaper, literacy "
    "spread, and scholars could compare identical copies of the same text for the first "
    "time. Historians still debate how much the press changed the pace of the scientific "
    "revolution, but few doubt that it changed how ideas travelled. Pamphlets carried "
    "arguments across borders in weeks rather than years, and printed tables of numbers, "
    "maps and diagrams could be reproduced without the copying errors that had crept into "
    "manuscripts. Today the same questions are asked about the internet: whether making "
    "information abundant makes people wiser, or only busier, and how a society decides "
    "which of the many voices it hears deserve to be trusted.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens each request generates in the timed runs (default 64)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per batch size; the median is reported (default 3)")
    parser.add_argument("--batches", type=int, nargs="+", default=(1, 16),
                        help="batch sizes timed (default 1 16)")


def text_logits(loaded, token_ids: list[int], block_size: int = 16, kv_cache_dtype: str = "auto"):
    """f32[n, V] logits of every position of ``token_ids`` (n tokens), one prefill step
    (its attention reads every key and value back from the cache, so an fp8 cache's
    rounding is in every position's logits)."""
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.config import kv_cache_dtype_name
    from jaxserve.model.attention import default_backend
    from jaxserve.model.kv_cache import NULL_BLOCK, init_kv_cache
    from jaxserve.worker.inputs import StepLayout, pack
    from jaxserve.worker.model_runner import run_body_logits

    config, graphdef, state = loaded
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    cache = init_kv_cache(config, num_blocks + 1, block_size,
                          jnp.dtype(kv_cache_dtype_name(kv_cache_dtype, "float32")))
    block_table = jnp.full((2, num_blocks), NULL_BLOCK, jnp.int32)  # row 0 + the padding row
    layout = StepLayout.for_bucket(n, 1, block_size)
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    buffer = pack(layout, seed=0, step_id=0, input_ids=i32(token_ids), rows=i32([0]),
                  num_computed=i32([0]), num_tokens=i32([n]), sample=i32([0]),
                  append_rows=i32([0] * num_blocks), append_index=i32(range(num_blocks)),
                  append_blocks=i32(range(1, num_blocks + 1)))
    logits, _, _ = run_body_logits(graphdef, state, cache, block_table, jnp.zeros(2, jnp.int32),
                                   jnp.asarray(buffer), layout=layout,
                                   backend=default_backend(config.head_dim))
    return np.asarray(logits)[:n]


def perplexity(loaded, token_ids: list[int], block_size: int = 16,
               kv_cache_dtype: str = "auto") -> float:
    """exp of the mean negative log-likelihood of ``token_ids[1:]``, one prefill step."""
    import numpy as np

    logits = text_logits(loaded, token_ids, block_size, kv_cache_dtype).astype(np.float64)[:-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -logp[np.arange(len(token_ids) - 1), token_ids[1:]].mean()
    return float(math.exp(nll))


def decode_tokens_per_s(model_dir: str, tokenizer: str | None, quantization: str | None,
                        batches: tuple[int, ...], new_tokens: int, repeats: int = 3,
                        kv_cache_dtype: str = "auto"
                        ) -> tuple[dict[str, float], list[list[int]]]:
    """({"batch_<B>": tokens/s}, the largest batch's greedy token ids) of ``jaxserve.LLM``
    generating ``new_tokens`` per request (the median of ``repeats`` timed runs)."""
    from jaxserve import LLM, SamplingParams

    top = max(batches)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out, tokens = {}, []
    with LLM(model_dir, tokenizer=tokenizer, quantization=quantization,
             kv_cache_dtype=kv_cache_dtype, max_num_seqs=top,
             max_num_batched_tokens=max(8 * top, 16), max_model_len=256) as llm:
        prompt = llm.get_tokenizer().encode(" The quick brown fox jumps over the")[:8]
        llm.generate([{"prompt_token_ids": prompt}] * top, params, use_tqdm=False)  # warm-up
        background = getattr(llm.engine.worker, "background_compile", None)
        if background is not None:  # its compiles would share the cores with the timed runs
            background.join()
        for b in batches:
            prompts = [{"prompt_token_ids": prompt[:7] + [prompt[-1] + i]} for i in range(b)]
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds.append(time.perf_counter() - start)
            out[f"batch_{b}"] = b * new_tokens / statistics.median(seconds)
            if b == top:
                tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return out, tokens


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How far two runs' greedy outputs agree: the fraction of identical sequences and the
    mean length of the common prefix as a fraction of the length."""
    prefixes = []
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefixes.append(n / max(len(x), 1))
    return {"identical": sum(x == y for x, y in zip(a, b)) / len(a),
            "mean_common_prefix": sum(prefixes) / len(prefixes)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    common.use_compilation_cache()
    from transformers import AutoTokenizer

    from jaxserve.model.loader import load_model, param_bytes

    model_dir = str(common.resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_dir)
    token_ids = tokenizer.encode(TEXT)
    result: dict[str, Any] = {"args": vars(args), "text_tokens": len(token_ids), "methods": {}}
    outputs: dict[str, list[list[int]]] = {}
    argmax: dict[str, Any] = {}
    for method, kv_cache_dtype in VARIANTS:
        name = variant_name(method, kv_cache_dtype)
        loaded = load_model(model_dir, "float32", quantization=method)
        entry = {"param_bytes": param_bytes(loaded[2]),
                 "perplexity": perplexity(loaded, token_ids, kv_cache_dtype=kv_cache_dtype)}
        argmax[name] = text_logits(loaded, token_ids, kv_cache_dtype=kv_cache_dtype).argmax(-1)
        del loaded
        entry["tokens_per_s"], outputs[name] = decode_tokens_per_s(
            model_dir, args.tokenizer, method, tuple(args.batches), args.new_tokens,
            args.repeats, kv_cache_dtype)
        result["methods"][name] = entry
        logger.info("%s: %s", name, entry)
    f32 = result["methods"]["float32"]
    result["against_float32"] = {}
    for name in [n for n in result["methods"] if n != "float32"]:
        entry = result["methods"][name]
        result["against_float32"][name] = {
            "perplexity_delta": entry["perplexity"] - f32["perplexity"],
            "perplexity_delta_relative": entry["perplexity"] / f32["perplexity"] - 1,
            "greedy_agreement": greedy_agreement(outputs["float32"], outputs[name]),
            # teacher-forced: the two models' most likely next token at each position
            "next_token_argmax_agreement": float((argmax["float32"] == argmax[name]).mean()),
            "speedup": {k: entry["tokens_per_s"][k] / f32["tokens_per_s"][k]
                        for k in f32["tokens_per_s"]}}
    result["environment"] = common.environment()
    return result


def main(argv=None) -> int:
    _, result, path = common.run_cli(NAME, __doc__, add_arguments, run, argv)
    batches = list(result["methods"]["float32"]["tokens_per_s"])
    print("| method | params MB | perplexity (Δ vs f32) | argmax agreement | "
          + " | ".join(f"{k.replace('_', ' ')} tok/s (× f32)" for k in batches)
          + " | greedy identical / common prefix |")
    print("|---" * (5 + len(batches)) + "|")
    for name, entry in result["methods"].items():
        cmp = result["against_float32"].get(name)
        delta = ("" if cmp is None else f" ({cmp['perplexity_delta']:+.3f}, "
                 f"{cmp['perplexity_delta_relative']:+.1%})")
        speeds = " | ".join(f"{v:.1f}" + ("" if cmp is None else f" ({cmp['speedup'][k]:.2f}×)")
                            for k, v in entry["tokens_per_s"].items())
        agree = "—" if cmp is None else f"{cmp['next_token_argmax_agreement']:.1%}"
        greedy = ("—" if cmp is None else f"{cmp['greedy_agreement']['identical']:.0%} / "
                  f"{cmp['greedy_agreement']['mean_common_prefix']:.0%}")
        print(f"| {name} | {entry['param_bytes'] / 1e6:.1f} | {entry['perplexity']:.3f}{delta} | "
              f"{agree} | {speeds} | {greedy} |")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
