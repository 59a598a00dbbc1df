"""An asyncio load generator for a jaxserve server (``jaxserve.client.AsyncClient``).

``run_load`` sends a workload's requests as token-id prompts (greedy,
``ignore_eos``, streaming) with Poisson arrivals at ``request_rate``
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
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Sequence
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


async def run_load(target: str, workload: Workload, *, request_rate: float = math.inf,
                   max_concurrency: int | None = None, seed: int = 0, timeout: float = 600.0,
                   progress: Any = None) -> tuple[list[RequestRecord], float]:
    """Sends the workload to ``target``; returns (records in workload order, duration in s).

    Args:
      request_rate: mean requests/s of the Poisson arrivals; ``inf`` sends all at once.
      max_concurrency: most requests in flight (None: unlimited).
      timeout: per-request deadline in seconds.
      progress: a tqdm bar (or anything with ``update(n)``), advanced per finished request.
    """
    from jaxserve.client import AsyncClient

    offsets = arrival_offsets(len(workload), request_rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with AsyncClient(target) as client:
        await client.wait_ready(timeout=60)
        start = time.perf_counter()

        async def send(i: int) -> RequestRecord:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                record = await _one(client, workload.prompts[i], workload.output_lens[i], timeout)
            else:
                async with limit:
                    record = await _one(client, workload.prompts[i], workload.output_lens[i],
                                        timeout)
            if progress is not None:
                progress.update(1)
            return record

        records = await asyncio.gather(*(send(i) for i in range(len(workload))))
    finish = max((r.end for r in records), default=start)
    return list(records), finish - start


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
