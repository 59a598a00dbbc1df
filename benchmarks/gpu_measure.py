"""One GPU command: kernel, served step, offline throughput and serving, in one JSON.

For a session with a GPU for a few minutes (``scripts/gpu_measure.sh`` wraps
it). It first checks the imports every section needs and names the wheels to
bring for those missing (docs/benchmarks.md, "One GPU command", says how to
carry them to a machine without a package index), then runs each section in a
child process of its own (``benchmarks.gpu_sections``) under its own time
budget (``--budget-SECTION`` seconds), in this order:

1. ``kernel``: the attention kernel's achieved bandwidth on its quick grid
   (Llama-3-8B decode steps of 1 / 64 / 256 rows at 2k and 8k context), its
   error against the jnp reference, with traces in ``kernel_trace/``;
2. ``decode``: the worker's served step of a Llama-3-8B-shaped model at each
   ``--decode-batch``, synchronous and dispatched ahead, against the
   weight-streaming floor measured in the same run;
3. ``model``: a random-weight Llama-3-8B-shaped Hugging Face directory
   written on the device (``--model-dir``; the tokenizer of
   ``--tokenizer-dir`` copied in, ``--model-vocab`` 49,152 to match the demo's);
4. ``offline``: ``jaxserve.LLM`` on ``--offline-requests`` ShareGPT-like
   requests (``--max-num-seqs`` 256, ``--max-num-batched-tokens`` 8192),
   start-up and warm-up included in the section, output tokens/s of the timed run;
5. ``serve``: ``jaxserve serve`` started once, then the serving benchmark at
   each ``--concurrency`` over gRPC and over HTTP (``/v1/completions``):
   TTFT and TPOT p50/p99, output tokens/s.

After each section the JSON is rewritten, so a run cut short keeps what it
finished. A section that fails or runs past its budget is recorded as
``{"error": ...}`` (its process group killed and waited for, so its GPU
memory is free) and the next one still runs; ``offline`` and ``serve`` are
skipped with a reason when ``model`` failed. ``summary`` gathers the
headline numbers, among them batch-1 TPOT over the weight floor (bytes a
decode step streams / the GPU's nominal HBM bandwidth: H100 3.35 TB/s,
H200 4.8 TB/s, by ``nvidia-smi``'s name; ``--peak-gbps`` overrides).

The served dtype (``--served-dtype auto``) is bfloat16 on a GPU and float32
on a CPU. With ``JAX_PLATFORMS=cpu`` and tiny sizes every section runs on
the CPU: the smoke test of the path in tests/benchmarks, not a measurement.

Usage: python -m benchmarks.gpu_measure --json PATH --tokenizer-dir DIR [options]
Exit status 1 if a section failed or a kernel case disagreed with the reference.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

SECTIONS = ("kernel", "decode", "model", "offline", "serve")
NEEDS_MODEL = ("offline", "serve")
# Seconds per section on an H100/H200: 8 minutes in all with the imports check.
BUDGETS = {"kernel": 60, "decode": 60, "model": 40, "offline": 150, "serve": 150}
# Module -> the wheel that provides it, for every import of the sections: what a machine
# without a package registry must already have or be brought as wheels.
IMPORTS = {
    "jax": "jax", "jaxlib": "jaxlib", "flax": "flax", "numpy": "numpy",
    "transformers": "transformers", "tokenizers": "tokenizers", "torch": "torch",
    "safetensors": "safetensors", "grpc": "grpcio", "google.protobuf": "protobuf",
    "grpc_health": "grpcio-health-checking", "grpc_reflection": "grpcio-reflection",
    "fastapi": "fastapi", "starlette": "starlette", "uvicorn": "uvicorn",
    "pydantic": "pydantic", "pydantic_core": "pydantic_core",
    "annotated_types": "annotated-types", "typing_inspection": "typing-inspection",
    "annotated_doc": "annotated-doc", "opentelemetry": "opentelemetry-api", "gguf": "gguf",
    "tqdm": "tqdm", "httpx": "httpx", "prometheus_client": "prometheus-client",
}
# Nominal HBM bandwidth (GB/s) by the GPU's name, from the vendors' data sheets.
NOMINAL_GBPS = {"H200": 4800.0, "H100": 3350.0}


def make_parser() -> argparse.ArgumentParser:
    """The flags of the whole command (each section's child process takes them all)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="the one output file")
    p.add_argument("--skip", default="", help="comma-separated sections not to run")
    for name in SECTIONS:
        p.add_argument(f"--budget-{name}", type=float, default=BUDGETS[name],
                       help=f"seconds for the {name} section (default {BUDGETS[name]})")
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="HBM bandwidth in GB/s for the floors (default: by GPU name)")
    # kernel
    p.add_argument("--kernel-dtype", default=None, choices=["bfloat16", "float32"],
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--kernel-iters", type=int, default=8,
                   help="n: chains of n and 2n kernel calls")
    p.add_argument("--kernel-repeats", type=int, default=10)
    # decode
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden-scale", type=int, default=1, help="divide widths (smoke tests)")
    p.add_argument("--decode-batch", default="1,64")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--decode-iters", type=int, default=20)
    p.add_argument("--backend", default="pallas", help="the decode's attention backend")
    p.add_argument("--dtype", default="bfloat16", help="the decode's dtype")
    # model (Llama-3-8B's shape; the vocabulary of the demo tokenizer)
    p.add_argument("--tokenizer-dir", default=".gpu-tokenizer",
                   help="directory with tokenizer.json (the demo model's) to copy into the model "
                        "(default .gpu-tokenizer/, which scripts/gpu_wheels.sh fills)")
    p.add_argument("--model-dir", default="/tmp/jaxserve-gpu-measure-model",
                   help="where the model section writes the model (not under $OUT: ~15 GB)")
    p.add_argument("--model-layers", type=int, default=32)
    p.add_argument("--model-hidden", type=int, default=4096)
    p.add_argument("--model-intermediate", type=int, default=14336)
    p.add_argument("--model-heads", type=int, default=32)
    p.add_argument("--model-kv-heads", type=int, default=8)
    p.add_argument("--model-vocab", type=int, default=49152)
    p.add_argument("--served-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="dtype of the model, LLM and server (auto: bfloat16 on GPU, else float32)")
    p.add_argument("--seed", type=int, default=0)
    # offline and serve
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--input-range", type=int, nargs=2, default=(32, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--output-range", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    p.add_argument("--offline-requests", type=int, default=1000)
    p.add_argument("--concurrency", default="1,64,256")
    p.add_argument("--serve-requests", type=int, default=768,
                   help="most requests per concurrency level (at least 8 and 3 x C are sent)")
    p.add_argument("--serve-backends", default="grpc,openai")
    p.add_argument("--serve-args", default="", help="extra `jaxserve serve` flags, one string")
    p.add_argument("--serve-ready-timeout", type=float, default=900.0)
    return p


def missing_imports() -> dict[str, str]:
    """Module -> wheel for each import of ``IMPORTS`` this interpreter cannot find."""
    missing = {}
    for module, wheel in IMPORTS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing[module] = wheel
    return missing


def gpu_name() -> str | None:
    """``nvidia-smi``'s name of GPU 0, or None (no GPU, or ``JAX_PLATFORMS=cpu``)."""
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = out.stdout.strip().splitlines()
    return names[0].strip() if out.returncode == 0 and names else None


def nominal_gbps(name: str | None) -> float | None:
    for kind, gbps in NOMINAL_GBPS.items():
        if name and kind in name:
            return gbps
    return None


def _write(path: str, result: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def _end_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the child's process group, SIGKILL after ``grace`` s; waits until it is gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)  # any process of the group left (a worker holding the GPU)?
            except ProcessLookupError:
                proc.wait()
                return
            proc.poll()
            time.sleep(0.2)
    proc.wait()


def run_section(name: str, argv: list[str], budget: float, part: str) -> dict:
    """Runs one section in its own process group; its result dict, or ``{"error": ...}``."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_sections", name, "--part", part, *argv]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        return {"error": f"timed out after its {budget:g} s budget (--budget-{name})"}
    _end_group(proc)  # a server or worker it left behind
    try:
        with open(part) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"error": f"exited {proc.returncode} without a result"}


def summarize(result: dict) -> dict:
    """Headline numbers of the sections that finished."""
    summary = {}
    kernel = result.get("kernel", {})
    if "cases" in kernel:
        summary["kernel_pct_of_peak"] = {r["case"]: r.get("pct_of_peak") for r in kernel["cases"]}
        summary["kernel_us"] = {r["case"]: (r.get("kernel_us"), r.get("trace_us"))
                                for r in kernel["cases"]}
        summary["kernel_agrees"] = all(r["agrees"] for r in kernel["cases"])
    decode = result.get("decode", {})
    if "steps" in decode:
        summary["decode_floor_ms"] = decode["floor_ms"]
        summary["decode_ratio_to_weight_floor"] = {
            key: step["ratio_to_weight_floor"] for key, step in decode["steps"].items()}
    model = result.get("model", {})
    gbps = result.get("nominal_gbps")
    floor_ms = None
    if "decode_bytes" in model:
        summary["model_seconds"] = model["seconds"]
        if gbps:
            floor_ms = 1e3 * model["decode_bytes"] / (gbps * 1e9)
            summary["weight_floor_ms"] = floor_ms
    offline = result.get("offline", {})
    if "jaxserve" in offline:
        leg = offline["jaxserve"]
        summary["offline"] = {k: leg.get(k) for k in (
            "output_tokens_per_s", "elapsed", "load_seconds", "warmup_seconds", "compiles")}
    serve = result.get("serve", {})
    if "ready_seconds" in serve:
        summary["serve_ready_seconds"] = serve["ready_seconds"]
        for backend in ("grpc", "openai"):
            runs = serve.get(backend)
            if not isinstance(runs, dict) or "error" in runs:
                continue
            table = {}
            for scenario, m in runs.items():
                row = {"tpot_p50_ms": m["tpot_ms"]["p50"], "tpot_p99_ms": m["tpot_ms"]["p99"],
                       "ttft_p50_ms": m["ttft_ms"]["p50"], "ttft_p99_ms": m["ttft_ms"]["p99"],
                       "output_tok_s": m["output_throughput"], "failed": m["failed"]}
                if scenario == "concurrency=1" and floor_ms:
                    row["tpot_p50_over_weight_floor"] = m["tpot_ms"]["p50"] / floor_ms
                table[scenario] = row
            summary[f"serve_{backend}"] = table
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = make_parser().parse_args(argv)
    name = gpu_name()
    served_dtype = opts.served_dtype
    if served_dtype == "auto":
        served_dtype = "bfloat16" if name else "float32"
    child_argv = [*argv, "--served-dtype", served_dtype]
    missing = missing_imports()
    result = dict(started_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  gpu=name, nominal_gbps=opts.peak_gbps or nominal_gbps(name),
                  python=platform.python_version(), served_dtype=served_dtype, args=vars(opts),
                  missing_imports=missing, wall_s={})
    print(f"GPU {name}, served dtype {served_dtype}", flush=True)
    if missing:
        print("missing imports: " + ", ".join(sorted(missing)) + "\nbring these wheels "
              "(docs/benchmarks.md, 'One GPU command'): " + " ".join(sorted(set(
                  missing.values()))), flush=True)
    _write(opts.json, result)
    work = tempfile.mkdtemp(prefix="gpu_measure_")  # the sections' own files, outside $OUT
    skip = {s for s in opts.skip.split(",") if s}
    failed = False
    for section in SECTIONS:
        if section in skip:
            continue
        start = time.perf_counter()
        if section in NEEDS_MODEL and "error" in result.get("model", {}):
            result[section] = {"error": "not run: the model section did not write a model"}
        else:
            print(f"== {section} (budget {getattr(opts, f'budget_{section}'):g} s)", flush=True)
            result[section] = run_section(section, child_argv,
                                          getattr(opts, f"budget_{section}"),
                                          os.path.join(work, f"{section}.json"))
        failed |= "error" in result[section]
        result["wall_s"][section] = time.perf_counter() - start
        result["summary"] = summarize(result)
        _write(opts.json, result)
    failed |= not result.get("summary", {}).get("kernel_agrees", True)
    print(json.dumps(result.get("summary", {}), indent=1), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
