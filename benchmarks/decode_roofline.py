"""Decode roofline: the batch-1 decode step against the weight-streaming floor.

Run: ``jaxserve bench decode_roofline [--steps N] [--profile DIR]`` (or
``python -m benchmarks.decode_roofline``).

At batch 1 every decode step reads all the weights the token touches once:
every layer's matrices, the final norm and the LM head (a tied embedding
counts once, as the LM head; an untied input embedding is only gathered, one
row, so it does not count). The floor is those bytes over the memory
bandwidth, measured in the same run (before and after the decode steps) as
the fastest of three XLA programs that stream one large float32 array
(``--bandwidth-mib``, default 512 MiB, far beyond the caches): the
matrix-vector product ``W[K, N] @ y``, the vector-matrix product
``x[1, K] @ W`` (the model's layout, kernels ``[in, out]``) and a full sum
of ``W`` (``measure_bandwidth``). The step time is the median wall time of
``EngineCore.step()`` over the decode steps of one request
(``--prompt-len`` tokens, then ``--steps`` decode steps after
``--warmup-steps``), so it includes the engine's host work; the worker's
own time is reported beside it. Ratio = floor / median step (1.0 = at the
roofline); on a shared machine floor / fastest step is reported too.

Writes ``<results>/decode_roofline.json`` and ``decode_roofline.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import sys
import time
from typing import Any

from benchmarks import common
from benchmarks.jaxserve_leg import add_arguments as jaxserve_leg_arguments

logger = logging.getLogger(__name__)

NAME = "decode_roofline"
_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    jaxserve_leg_arguments(parser)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps (default 64)")
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--bandwidth-mib", type=int, default=512,
                        help="size of the streamed array (default 512 MiB)")
    parser.add_argument("--bandwidth-reps", type=int, default=10)
    parser.add_argument("--max-num-seqs", type=int, default=64,
                        help="the engine's rows (attention metadata is padded to it; default 64)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--scan-layers", action="store_true",
                        help="run the layers with jax.lax.scan over stacked weights")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="profile the timed decode steps into DIR and print the breakdown")


def weight_bytes(model_dir: str | pathlib.Path, itemsize: int = 4,
                 quantization: str | None = None) -> dict[str, int]:
    """Bytes a batch-1 decode step reads, from the safetensors headers (see the module docstring).

    Args:
      itemsize: bytes per parameter in the run (4: float32), whatever the file stores.
      quantization: "int8": jaxserve's weight-only int8 (``jaxserve.model.quantization``):
        every 2-D weight (the linear kernels, the embedding, the LM head) is 1 byte a
        parameter plus one float32 scale per output row (its first axis, HF's
        ``[out, in]``); norms and biases stay at ``itemsize``. "int4": the same for the
        embedding and the LM head, and the other 2-D weights (the decoder's kernels)
        half a byte a parameter plus a float32 step and offset per 32 (0.75 bytes).

    Returns:
      ``{"decode_bytes", "all_bytes", "num_params"}``.
    """
    sizes: dict[str, int] = {}
    stored: dict[str, int] = {}  # bytes in the run
    for path in sorted(pathlib.Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for dim in info["shape"]:
                numel *= dim
            sizes[name] = numel
            shape = info["shape"]
            head = name.endswith(("embed_tokens.weight", "lm_head.weight"))
            if quantization is None or len(shape) != 2:
                stored[name] = numel * itemsize
            elif quantization == "int8" or head:
                stored[name] = numel + 4 * shape[0]
            else:  # int4: packed values + (step, offset) f32 per 32 inputs
                stored[name] = numel // 2 + 8 * (numel // 32)
    if not sizes:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    total = sum(sizes.values())
    untied_embed = [n for n in sizes if n.endswith("embed_tokens.weight")] if any(
        n.endswith("lm_head.weight") for n in sizes) else []
    all_bytes = sum(stored.values())
    decode = all_bytes - sum(stored[n] for n in untied_embed)
    return {"decode_bytes": decode, "all_bytes": all_bytes, "num_params": total}


def _median_seconds(fn, *args, reps: int) -> float:
    fn(*args).block_until_ready()  # compile
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bandwidth(mib: int, reps: int) -> dict[str, float]:
    """GB/s (1e9 bytes/s) at which XLA streams one f32 array ``W [K, N]``, three ways.

    ``matvec`` ``W @ y[N]`` (rows contiguous: the model's layout at batch 1),
    ``vecmat`` ``x[1, K] @ W`` and ``sum``
    (a reduction); ``best_gb_s`` is the fastest of them.
    """
    import jax
    import jax.numpy as jnp

    n = 4096
    k = max(1, (mib << 20) // (4 * n))
    key_w, key_x, key_y = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(key_w, (k, n), jnp.float32)  # [K, N] f32
    x = jax.random.normal(key_x, (1, k), jnp.float32)  # [1, K] f32
    y = jax.random.normal(key_y, (n,), jnp.float32)  # [N] f32
    nbytes = w.size * 4
    matmul = jax.jit(lambda a, b: a @ b)
    seconds = {"matvec": _median_seconds(matmul, w, y, reps=reps),
               "vecmat": _median_seconds(matmul, x, w, reps=reps),
               "sum": _median_seconds(jax.jit(jnp.sum), w, reps=reps)}
    del w
    out = {"array_bytes": nbytes, **{f"{k}_gb_s": nbytes / v / 1e9 for k, v in seconds.items()}}
    out["best_gb_s"] = max(out[f"{k}_gb_s"] for k in seconds)
    return out


def decode_steps(llm, prompt_len: int, warmup: int, steps: int, seed: int,
                 profile_dir: str | None = None) -> dict[str, Any]:
    """Times ``engine.step()`` for one request's decode steps (after its prefill)."""
    import numpy as np

    from jaxserve import SamplingParams
    from jaxserve.engine import EngineCoreRequest

    engine = llm.engine
    vocab = engine.geometry.vocab_size
    prompt = np.random.default_rng(seed).integers(100 if vocab > 200 else 0, vocab,
                                                  prompt_len).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 2, ignore_eos=True)
    engine.add_request(EngineCoreRequest("roofline", prompt, params, time.time()))
    while True:  # the prefill (maybe chunked) until the first token comes out
        if any(o.new_token_ids for o in engine.step()):
            break
    for _ in range(warmup):
        engine.step()
    worker = engine.worker
    exec0 = getattr(worker, "execute_seconds", None)
    times = []

    def timed() -> None:
        for _ in range(steps):
            start = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - start)
            if sum(len(o.new_token_ids) for o in outs) != 1:
                raise RuntimeError("a decode step did not produce exactly one token")

    profile = None
    if profile_dir is None:
        timed()
    else:
        from benchmarks import profiling

        with profiling.profiled(profile_dir) as session:
            timed()
        profile = session.report()
    engine.abort_requests(["roofline"])
    result = {"step_ms": {"median": 1e3 * statistics.median(times), "min": 1e3 * min(times),
                          "mean": 1e3 * statistics.fmean(times)}, "steps": steps}
    if exec0 is not None:
        result["worker_execute_ms_mean"] = 1e3 * (worker.execute_seconds - exec0) / steps
    if profile is not None:
        result["profile"] = profile
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.profile:
        from benchmarks import profiling

        profiling.prepare_process()
    else:
        common.use_compilation_cache()
    from benchmarks import jaxserve_leg

    model_dir = str(common.resolve_model(args.model))
    weights = weight_bytes(model_dir)
    options = jaxserve_leg.EngineOptions(max_num_seqs=args.max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         scan_layers=args.scan_layers,
                                         attention_backend=args.attention_backend)
    start = time.perf_counter()
    llm = jaxserve_leg.make_llm(model_dir, args.tokenizer, options, profiled=bool(args.profile))
    startup_s = time.perf_counter() - start
    try:
        bandwidth_before = measure_bandwidth(args.bandwidth_mib, args.bandwidth_reps)
        decode = decode_steps(llm, args.prompt_len, args.warmup_steps, args.steps, args.seed,
                              args.profile)
        bandwidth_after = measure_bandwidth(args.bandwidth_mib, args.bandwidth_reps)
    finally:
        llm.shutdown()
    best = max(bandwidth_before["best_gb_s"], bandwidth_after["best_gb_s"])
    floor_ms = 1e3 * weights["decode_bytes"] / (best * 1e9)
    step_ms = decode["step_ms"]["median"]
    return {"benchmark": NAME, "args": vars(args), "environment": common.environment(),
            "engine_options": options.as_dict(), "weights": weights,
            "bandwidth": {"before": bandwidth_before, "after": bandwidth_after, "best_gb_s": best},
            "floor_ms": floor_ms, "decode": decode, "startup_s": startup_s,
            "roofline_ratio": floor_ms / step_ms,
            "roofline_ratio_best_step": floor_ms / decode["step_ms"]["min"],
            "tokens_per_s": 1e3 / step_ms, "floor_tokens_per_s": 1e3 / floor_ms}


def report(result: dict[str, Any]) -> str:
    w, b, d = result["weights"], result["bandwidth"], result["decode"]
    scan = " scanned layers," if result["engine_options"].get("scan_layers") else ""
    lines = [f"decode roofline (batch 1,{scan} load average "
             f"{result['environment']['load_average']}; engine start-up "
             f"{result.get('startup_s', float('nan')):.1f} s):",
             f"  weights read per step  {w['decode_bytes'] / 1e6:8.1f} MB",
             f"  bandwidth (best)       {b['best_gb_s']:8.1f} GB/s  ("
             + ", ".join(f"{k} {b['before'][k + '_gb_s']:.1f} / {b['after'][k + '_gb_s']:.1f}"
                         for k in ("matvec", "vecmat", "sum")) + " GB/s before / after)",
             f"  floor                  {result['floor_ms']:8.2f} ms/token  "
             f"({result['floor_tokens_per_s']:.1f} tok/s)",
             f"  decode step (median)   {d['step_ms']['median']:8.2f} ms/token  "
             f"({result['tokens_per_s']:.1f} tok/s; min {d['step_ms']['min']:.2f})"]
    if "worker_execute_ms_mean" in d:
        lines.append(f"  worker execute (mean)  {d['worker_execute_ms_mean']:8.2f} ms")
    lines.append(f"  roofline ratio (floor / median step): {result['roofline_ratio']:.2f}  "
                 f"(floor / fastest step: {result['roofline_ratio_best_step']:.2f})")
    if "profile" in d:
        from benchmarks import profiling

        lines.append(profiling.format_report(d["profile"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, result, path = common.run_cli(NAME, __doc__, add_arguments, run, argv)
    from benchmarks import plots

    png = plots.bars({"floor": result["floor_ms"],
                      "decode step": result["decode"]["step_ms"]["median"]},
                     pathlib.Path(args.results) / f"{NAME}.png",
                     f"batch-1 decode: ratio {result['roofline_ratio']:.2f}", "ms per token")
    print(report(result))
    print(f"results: {path}" + (f"\nplot: {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
