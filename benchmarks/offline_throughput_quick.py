"""Offline throughput of ``jaxserve.LLM`` on the demo model: N requests, fixed lengths.

Run: ``python -m benchmarks.offline_throughput_quick [--num-requests 64] [--input-len 64]
[--output-len 64]``

Random-token prompts (``--input-len`` tokens each) and ``--output-len``
generated tokens per request (``ignore_eos``, greedy). The workload runs
twice; the second run is timed, so every (T, R) executable it needs is
already compiled. Reports requests/s, generated tokens/s and total
(prompt + generated) tokens/s of wall time, the steps taken, the mean
worker time per step and the engine's CPU time per step.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from jaxserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: demo model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.input_len + args.output_len + 16,
              num_kv_blocks=args.num_requests * (-(-(args.input_len + args.output_len) // 16)) + 64)
    vocab = llm.engine.geometry.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, vocab, args.input_len).tolist() for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles what the run needs
    logging.warning("warm-up (with compiles) %.1f s", time.perf_counter() - start)
    prompts = [rng.integers(100, vocab, args.input_len).tolist() for _ in range(args.num_requests)]
    engine, worker = llm.engine, llm.engine.worker
    steps0, sched0, exec0 = engine.num_steps, engine.schedule_seconds, worker.execute_seconds
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    steps = engine.num_steps - steps0
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    total = generated + sum(len(p) for p in prompts)
    print(f"{args.num_requests} requests x ({args.input_len} in, {args.output_len} out), "
          f"max_num_seqs {args.max_num_seqs}, budget {args.max_num_batched_tokens}:")
    print(f"  {elapsed:.1f} s  {args.num_requests / elapsed:.2f} req/s  "
          f"{generated / elapsed:.1f} generated tok/s  {total / elapsed:.1f} total tok/s")
    print(f"  {steps} steps; worker {1e3 * (worker.execute_seconds - exec0) / steps:.1f} ms/step, "
          f"engine CPU {1e3 * (engine.schedule_seconds - sched0) / steps:.2f} ms/step")


if __name__ == "__main__":
    main()
