"""Runs workloads through one vLLM engine and writes their timing (run by ``vllm_leg`` in vLLM's venv).

``python vllm_runner.py --model DIR --workload IN.json --out OUT.json``.
A plain script with no jaxserve imports: it runs under another Python
environment (vLLM brings its own torch). IN.json holds ``workloads``, a
list of ``{"name", "prompts" (token ids), "output_lens"}``, run in order on
one ``vllm.LLM`` (loaded once); OUT.json gets ``load_seconds`` (engine
construction), the vLLM version and, per workload name, ``elapsed``
(seconds), ``output_tokens`` and ``warmup_seconds``. Each workload's warm-up:
the same prompt lengths with other tokens and 2 output tokens. Greedy,
``ignore_eos``, float32 unless ``--dtype``, like the other legs.
``--memory-fraction`` is vLLM's ``gpu_memory_utilization``, which its CPU
backend reads as the fraction of the NUMA node's memory to reserve.
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
    parser.add_argument("--memory-fraction", type=float, default=0.5,
                        help="vLLM's gpu_memory_utilization (on the CPU: of the node's memory)")
    args = parser.parse_args()
    with open(args.workload) as f:
        workloads = json.load(f)["workloads"]

    import vllm
    from vllm import LLM, SamplingParams

    max_len = max(len(p) + n for w in workloads
                  for p, n in zip(w["prompts"], w["output_lens"])) + 16
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max_len, seed=0,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=max(args.max_num_batched_tokens, max_len),
              gpu_memory_utilization=args.memory_fraction)
    load = time.perf_counter() - start
    rng = random.Random(1)
    vocab = llm.get_tokenizer().vocab_size
    results = {}
    for w in workloads:
        prompts, output_lens = w["prompts"], w["output_lens"]
        warm = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in p]} for p in prompts]
        start = time.perf_counter()
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
        warmup = time.perf_counter() - start
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in output_lens]
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        results[w["name"]] = {"elapsed": elapsed, "warmup_seconds": warmup,
                              "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}
        with open(args.out, "w") as f:  # rewritten after each workload: a crash keeps those done
            json.dump({"load_seconds": load, "vllm": vllm.__version__,
                       "memory_fraction": args.memory_fraction, "workloads": results}, f)


if __name__ == "__main__":
    main()
