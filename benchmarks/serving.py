"""Serving benchmark: TTFT, TPOT, ITL, e2e latency and throughput of a running server.

Run: ``jaxserve bench serving [--server HOST:PORT] [--request-rate R]
[--concurrency 1 4 16] [--backend grpc|openai [--base-url URL --vocab-size V]]``
(or ``python -m benchmarks.serving``).

``--backend openai`` drives the OpenAI-compatible HTTP API (streamed
``/v1/completions``) instead of gRPC: of the server started here, or of any
OpenAI-compatible server at ``--base-url`` (vLLM's too; then give
``--vocab-size``, or ``--server`` for a jaxserve gRPC port to read it from).

Without ``--server`` it starts ``jaxserve serve`` on a free loopback port
(``--serve-args`` passes flags through; the server log goes to
``<results>/serving_server.log``) and stops it at the end. Scenarios, each
on fresh ShareGPT-like prompts (``benchmarks.dataset``; no shared prefixes):

- ``poisson``: ``--num-requests`` at ``--request-rate`` requests/s,
  Poisson arrivals, no concurrency limit;
- ``max``: the same number of requests sent at once (maximum concurrency);
- ``concurrency=C`` for each ``--concurrency`` level: requests kept C in
  flight (at least 8 and 3·C requests, at most ``--num-requests``).

Every request is greedy with ``ignore_eos`` (exact output lengths) and
streamed; metrics are defined in ``benchmarks.load_generator``. Writes
``<results>/serving.json`` (per-scenario percentiles and per-request
records), ``serving_throughput.png`` (throughput vs concurrency) and
``serving_latency_cdf.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import pathlib
import sys
from typing import Any

from benchmarks import common, load_generator, plots
from benchmarks.dataset import sharegpt_like

logger = logging.getLogger(__name__)

NAME = "serving"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument("--server", default=None, metavar="HOST:PORT",
                        help="target a running server instead of starting one")
    parser.add_argument("--serve-args", default="", metavar="'FLAGS'",
                        help="extra `jaxserve serve` flags, one string (e.g. '--max-num-seqs 16')")
    parser.add_argument("--num-requests", type=int, default=32, help="requests (default 32)")
    parser.add_argument("--input-range", type=int, nargs=2, default=(32, 512),
                        metavar=("MIN", "MAX"), help="prompt lengths (default 32 512)")
    parser.add_argument("--output-range", type=int, nargs=2, default=(32, 128),
                        metavar=("MIN", "MAX"), help="output lengths (default 32 128)")
    parser.add_argument("--request-rate", type=float, default=1.0,
                        help="Poisson scenario's requests/s (default 1; 0 skips it)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=(1, 4, 16),
                        help="concurrency levels to sweep (default 1 4 16)")
    parser.add_argument("--no-max", action="store_true", help="skip the all-at-once scenario")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request deadline (s)")
    parser.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                        help="gRPC GenerateService, or the OpenAI HTTP API (default grpc)")
    parser.add_argument("--base-url", default=None, metavar="URL",
                        help="openai backend: a running OpenAI-compatible server "
                             "(http://host:8000)")
    parser.add_argument("--served-model", default=None,
                        help="openai backend: the `model` field (default: the server's)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="token ids of the random prompts are below this (default: the "
                             "served model's, read over gRPC)")


def scenarios(args: argparse.Namespace) -> list[dict[str, Any]]:
    """(name, number of requests, rate, concurrency limit) of each scenario, in run order."""
    n = args.num_requests
    out = []
    if args.request_rate > 0:
        out.append({"name": f"poisson@{args.request_rate:g}/s", "num_requests": n,
                    "request_rate": args.request_rate, "max_concurrency": None})
    if not args.no_max:
        out.append({"name": "max", "num_requests": n, "request_rate": math.inf,
                    "max_concurrency": None})
    for c in args.concurrency:
        out.append({"name": f"concurrency={c}", "num_requests": min(n, max(8, 3 * c)),
                    "request_rate": math.inf, "max_concurrency": c})
    return out


async def _run_scenarios(target: str, args: argparse.Namespace, vocab: int) -> list[dict]:
    from tqdm.auto import tqdm

    results = []
    transport = dict(backend=args.backend, model=args.served_model)
    warm = sharegpt_like(4, vocab, seed=args.seed + 999, input_range=(16, 64),
                         output_range=(4, 8))
    await load_generator.run_load(target, warm, timeout=args.timeout,  # first-call overheads
                                  **transport)
    for k, sc in enumerate(scenarios(args)):
        workload = sharegpt_like(sc["num_requests"], vocab, seed=args.seed + k,
                                 input_range=tuple(args.input_range),
                                 output_range=tuple(args.output_range))
        load = common.load_average()
        with tqdm(total=len(workload), desc=sc["name"], unit="req") as bar:
            records, duration = await load_generator.run_load(
                target, workload, request_rate=sc["request_rate"],
                max_concurrency=sc["max_concurrency"], seed=args.seed + k,
                timeout=args.timeout, progress=bar, **transport)
        summary = load_generator.summarize(records, duration)
        logger.info("%s: %.1f output tok/s, TTFT p50 %.0f ms, TPOT p50 %.1f ms", sc["name"],
                    summary["output_throughput"], summary["ttft_ms"]["p50"],
                    summary["tpot_ms"]["p50"])
        results.append({**sc, "load_average": load, "workload": workload.summary(),
                        "summary": summary,
                        "requests": [{"prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
                                      "ttft_ms": None if r.ttft is None else 1e3 * r.ttft,
                                      "tpot_ms": None if r.tpot is None else 1e3 * r.tpot,
                                      "e2e_ms": 1e3 * r.e2e, "error": r.error}
                                     for r in records]})
    return results


def _model_vocab(target: str) -> int:
    from jaxserve.client import Client

    with Client(target, timeout=30) as client:
        return client.model_info().vocab_size


def run(args: argparse.Namespace) -> dict[str, Any]:
    server = None
    if args.server is None:
        from benchmarks.server_process import ServerProcess

        serve_args = args.serve_args.split()
        if args.model:
            serve_args = ["--model", args.model, *serve_args]
        if args.base_url is None:
            server = ServerProcess(serve_args,
                                   pathlib.Path(args.results) / f"{NAME}_server.log")
            server.start()
        grpc_target = None if server is None else server.target
    else:
        grpc_target = args.server
    if args.backend == "openai":
        target = args.base_url or server.base_url
    else:
        target = grpc_target
    try:
        if args.vocab_size is not None:
            vocab = args.vocab_size
        elif grpc_target is not None:
            vocab = _model_vocab(grpc_target)
        else:
            raise SystemExit("--base-url without --server: give --vocab-size")
        results = asyncio.run(_run_scenarios(target, args, vocab))
    finally:
        if server is not None:
            server.stop()
    return {"benchmark": NAME, "args": vars(args), "environment": common.environment(),
            "server": {"target": target, "started_here": server is not None,
                       "command": server.cmd if server else None,
                       "ready_seconds": server.ready_seconds if server else None},
            "scenarios": results}


def make_plots(result: dict[str, Any], results_dir: pathlib.Path) -> list[str]:
    levels = [{"concurrency": s["max_concurrency"], "summary": s["summary"]}
              for s in result["scenarios"] if s["max_concurrency"]]
    series = {s["name"]: {m: [r[m] for r in s["requests"] if r[m] is not None and not r["error"]]
                          for m in ("ttft_ms", "tpot_ms", "e2e_ms")}
              for s in result["scenarios"]}
    paths = [plots.throughput_vs_concurrency(levels, results_dir / f"{NAME}_throughput.png",
                                             "jaxserve serving: throughput vs concurrency"),
             plots.latency_cdf(series, results_dir / f"{NAME}_latency_cdf.png",
                               "jaxserve serving: latency CDF")]
    return [str(p) for p in paths if p is not None]


def report(result: dict[str, Any]) -> str:
    lines = [f"serving benchmark against {result['server']['target']} "
             f"({result['args'].get('backend', 'grpc')}):",
             f"  {'scenario':18s} {'req':>4s} {'fail':>4s} {'out tok/s':>9s} {'req/s':>6s} "
             + "".join(f"{m + ' p50/p90/p99 (ms)':>26s}" for m in ("TTFT", "TPOT", "ITL", "e2e"))
             + "  load avg"]
    for s in result["scenarios"]:
        m = s["summary"]
        cells = "".join(f"{m[k]['p50']:10.1f}{m[k]['p90']:8.1f}{m[k]['p99']:8.1f}"
                        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
        lines.append(f"  {s['name']:18s} {m['completed']:4d} {m['failed']:4d} "
                     f"{m['output_throughput']:9.1f} {m['request_throughput']:6.2f} {cells}"
                     f"  {s['load_average'][0]:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, result, path = common.run_cli(NAME, __doc__, add_arguments, run, argv)
    pngs = make_plots(result, pathlib.Path(args.results))
    print(report(result))
    print(f"results: {path}" + "".join(f"\nplot: {p}" for p in pngs))
    failed = sum(s["summary"]["failed"] for s in result["scenarios"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
