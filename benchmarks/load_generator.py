"""An asyncio load generator for a jaxserve server, over gRPC or the OpenAI HTTP API.

``run_load`` sends a workload's requests as token-id prompts (greedy,
``ignore_eos``, streaming) — through ``jaxserve.client.AsyncClient``
(``backend="grpc"``, target ``host:port``) or as streamed
``POST /v1/completions`` (``backend="openai"``, target a base URL such as
``http://host:8000``; any OpenAI-compatible server, vLLM's included) — with
Poisson arrivals at ``request_rate``
requests/s (``inf``: all at once), at most ``max_concurrency`` in flight,
and records for each request the send time and the arrival time of every
streamed chunk that carries tokens. ``summarize`` turns the records into
vLLM's serving metrics (benchmarks/benchmark_serving.py's definitions):

- TTFT: send → first token;
- TPOT: (e2e − TTFT) / (output tokens − 1), per request with > 1 token;
- ITL: the gap between consecutive token-carrying chunks (a chunk of k
  tokens is one gap, as vLLM counts a multi-token chunk);
- e2e latency: send → last response;
- throughput: completed requests and tokens over the run's duration
  (first send → last completion).

Over HTTP a chunk carries text, not token ids: each content chunk counts as
one token, and the last chunk takes the remainder of the final ``usage``
(``stream_options.include_usage``), so the token totals are exact and a
multi-token chunk is one ITL gap, as over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from benchmarks.common import percentiles
from benchmarks.dataset import Workload


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's timeline (seconds on ``time.perf_counter``'s clock)."""

    prompt_len: int
    max_tokens: int
    send: float
    chunks: tuple[tuple[float, int], ...]  # (arrival time, tokens in the chunk)
    end: float
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.send if self.chunks else None

    @property
    def e2e(self) -> float:
        return self.end - self.send

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 and self.ttft is not None else None

    @property
    def itl(self) -> list[float]:
        times = [t for t, _ in self.chunks]
        return [b - a for a, b in zip(times, times[1:])]


def arrival_offsets(n: int, request_rate: float, seed: int) -> np.ndarray:
    """Send times in seconds from the start: Poisson arrivals (exponential gaps), 0s for ``inf``.

    Raises:
      ValueError: a rate <= 0.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]) if n else gaps


async def _one(client, prompt: Sequence[int], max_tokens: int, timeout: float) -> RequestRecord:
    from jaxserve.client import JaxServeError

    chunks: list[tuple[float, int]] = []
    send = time.perf_counter()
    error = None
    try:
        async for delta in client.stream(list(prompt), temperature=0.0, max_tokens=max_tokens,
                                         ignore_eos=True, timeout=timeout):
            if delta.token_ids:
                chunks.append((time.perf_counter(), len(delta.token_ids)))
    except JaxServeError as err:
        error = f"{err.code.name}: {err.message}"
    end = time.perf_counter()
    if error is None and sum(n for _, n in chunks) != max_tokens:
        error = f"got {sum(n for _, n in chunks)} tokens, asked for {max_tokens}"
    return RequestRecord(len(prompt), max_tokens, send, tuple(chunks), end, error)


async def _one_http(client, prompt: Sequence[int], max_tokens: int, timeout: float,
                    model: str | None) -> RequestRecord:
    import json

    import httpx

    chunks: list[tuple[float, int]] = []
    send = time.perf_counter()
    error, usage = None, None
    body = {"prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as reply:
            if reply.status_code != 200:
                error = f"HTTP {reply.status_code}: {(await reply.aread()).decode()[:200]}"
            else:
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk.get("error"):
                        error = chunk["error"].get("message", "error")
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if any(c.get("text") for c in chunk.get("choices", ())):
                        chunks.append((time.perf_counter(), 1))
    except httpx.HTTPError as err:
        error = f"{type(err).__name__}: {err}"
    end = time.perf_counter()
    if error is None and usage is not None and chunks:
        last_time, _ = chunks[-1]
        chunks[-1] = (last_time, usage["completion_tokens"] - (len(chunks) - 1))
    if error is None and sum(n for _, n in chunks) != max_tokens:
        error = f"got {sum(n for _, n in chunks)} tokens, asked for {max_tokens}"
    return RequestRecord(len(prompt), max_tokens, send, tuple(chunks), end, error)


async def run_load(target: str, workload: Workload, *, request_rate: float = math.inf,
                   max_concurrency: int | None = None, seed: int = 0, timeout: float = 600.0,
                   progress: Any = None, backend: str = "grpc",
                   model: str | None = None) -> tuple[list[RequestRecord], float]:
    """Sends the workload to ``target``; returns (records in workload order, duration in s).

    Args:
      target: ``host:port`` (gRPC) or a base URL (``openai``).
      backend: ``"grpc"`` or ``"openai"`` (see the module docstring).
      model: the ``model`` field of HTTP requests (None: the server's default).
      request_rate: mean requests/s of the Poisson arrivals; ``inf`` sends all at once.
      max_concurrency: most requests in flight (None: unlimited).
      timeout: per-request deadline in seconds.
      progress: a tqdm bar (or anything with ``update(n)``), advanced per finished request.
    """
    if backend not in ("grpc", "openai"):
        raise ValueError(f"backend must be 'grpc' or 'openai', got {backend!r}")
    offsets = arrival_offsets(len(workload), request_rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with _client(target, backend) as client:
        start = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            if backend == "grpc":
                return await _one(client, workload.prompts[i], workload.output_lens[i], timeout)
            return await _one_http(client, workload.prompts[i], workload.output_lens[i],
                                   timeout, model)

        async def send(i: int) -> RequestRecord:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                record = await one(i)
            else:
                async with limit:
                    record = await one(i)
            if progress is not None:
                progress.update(1)
            return record

        records = await asyncio.gather(*(send(i) for i in range(len(workload))))
    finish = max((r.end for r in records), default=start)
    return list(records), finish - start


@contextlib.asynccontextmanager
async def _client(target: str, backend: str) -> AsyncIterator[Any]:
    """A ready ``AsyncClient`` (gRPC) or an ``httpx.AsyncClient`` on the base URL."""
    if backend == "grpc":
        from jaxserve.client import AsyncClient

        async with AsyncClient(target) as client:
            await client.wait_ready(timeout=60)
            yield client
        return
    import httpx

    async with httpx.AsyncClient(base_url=target, timeout=None,
                                 limits=httpx.Limits(max_connections=None)) as client:
        yield client


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """vLLM-style serving metrics (ms for latencies); see the module docstring."""
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ms = lambda xs: {k: 1e3 * v for k, v in percentiles(xs).items()}  # noqa: E731
    return {
        "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else float("nan"),
        "output_throughput": out_tokens / duration if duration > 0 else float("nan"),
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0
        else float("nan"),
        "output_tokens": out_tokens, "prompt_tokens": in_tokens,
        "ttft_ms": ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": ms([x for r in ok for x in r.itl]),
        "e2e_ms": ms([r.e2e for r in ok]),
    }
