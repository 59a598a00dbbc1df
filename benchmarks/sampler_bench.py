"""Sampler time per call: ``python -m benchmarks.sampler_bench``.

For each R (default 256 and 8) at V = 128,256 (Llama 3's vocabulary) and each
mix of rows, reports the median wall time of one ``sample`` call on device-
resident inputs (after a warm-up call; compile time is reported separately).

Mixes:
  greedy     every row temperature 0
  plain      temperature 0.8, no filters, no penalties
  full       top-k 50 + top-p 0.9 + min-p 0.05 + repetition / presence /
             frequency penalties + logit bias (nucleus inside the candidates)
  full_wide  top-p 0.95 on flat logits and top-k 1000: thresholds past the
             candidates, so the bisection fallback runs
  logprobs   plain + 20 raw logprobs per row

Logits are LM-like: a N(0, 2) bulk plus ~20 spiked tokens per row (most of
the mass), except ``full_wide``, which uses the flat bulk alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.sampler import build_sampling_metadata, sample

MIXES = {
    "greedy": SamplingParams(temperature=0.0),
    "plain": SamplingParams(temperature=0.8),
    "full": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05,
                           repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2,
                           logit_bias={100: 1.0, 200: -1.0}),
    "full_wide": SamplingParams(temperature=1.0, top_k=1000, top_p=0.95),
    "logprobs": SamplingParams(temperature=0.8, logprobs=20),
}


def make_logits(rows: int, vocab: int, peaked: bool, seed: int = 0) -> np.ndarray:
    """f32[R, V] LM-like logits (see the module docstring)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, (rows, vocab)).astype(np.float32)
    if peaked:
        spikes = rng.integers(0, vocab, (rows, 20))
        logits[np.arange(rows)[:, None], spikes] = rng.uniform(15.0, 20.0, (rows, 20))
    return logits


def bench(rows: int, vocab: int, mix: str, iters: int) -> tuple[float, float]:
    """Returns (compile seconds, median seconds per call)."""
    rng = np.random.default_rng(1)
    params = [MIXES[mix]] * rows
    prompts = [list(rng.integers(0, vocab, 64)) for _ in range(rows)]
    outputs = [list(rng.integers(0, vocab, 16)) for _ in range(rows)]
    md = jax.device_put(build_sampling_metadata(
        params, prompt_token_ids=prompts, output_token_ids=outputs, vocab_size=vocab))
    logits = jax.device_put(make_logits(rows, vocab, peaked=mix != "full_wide"))
    keys = [jax.random.fold_in(jax.random.key(0), i) for i in range(iters + 1)]
    start = time.perf_counter()
    compiled = sample.lower(logits, md, keys[0]).compile()
    compile_s = time.perf_counter() - start
    compiled(logits, md, keys[0]).token_ids.block_until_ready()
    times = []
    for key in keys[1:]:
        start = time.perf_counter()
        compiled(logits, md, key).token_ids.block_until_ready()
        times.append(time.perf_counter() - start)
    return compile_s, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 8])
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    print(f"backend={jax.default_backend()} devices={jax.device_count()} V={args.vocab}")
    print(f"{'R':>5} {'mix':<10} {'ms/call':>9} {'compile s':>10}")
    for rows in args.rows:
        for mix in args.mixes:
            compile_s, per_call = bench(rows, args.vocab, mix, args.iters)
            print(f"{rows:>5} {mix:<10} {per_call * 1e3:>9.2f} {compile_s:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
