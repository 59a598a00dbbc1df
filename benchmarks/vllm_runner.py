"""Runs a workload through vLLM and writes its timing (run by ``vllm_leg`` in vLLM's venv).

``python vllm_runner.py --model DIR --workload IN.json --out OUT.json``.
A plain script with no jaxserve imports: it runs under another Python
environment (vLLM brings its own torch). IN.json holds ``prompts`` (token
ids) and ``output_lens``; OUT.json gets ``elapsed``, ``output_tokens`` and
the vLLM version. Warm-up: the same prompt lengths with 2 output tokens.
Greedy, ``ignore_eos``, float32 unless ``--dtype``, like the other legs.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with open(args.workload) as f:
        workload = json.load(f)
    prompts, output_lens = workload["prompts"], workload["output_lens"]

    import vllm
    from vllm import LLM, SamplingParams

    max_len = max(len(p) + n for p, n in zip(prompts, output_lens)) + 16
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max_len, seed=0,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=max(args.max_num_batched_tokens, max_len))
    load = time.perf_counter() - start
    rng = random.Random(1)
    vocab = llm.get_tokenizer().vocab_size
    warm = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in p]} for p in prompts]
    start = time.perf_counter()
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    warmup = time.perf_counter() - start
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    with open(args.out, "w") as f:
        json.dump({"elapsed": elapsed, "output_tokens": generated, "load_seconds": load,
                   "warmup_seconds": warmup, "vllm": vllm.__version__}, f)


if __name__ == "__main__":
    main()
