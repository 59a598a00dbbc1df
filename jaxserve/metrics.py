"""Prometheus metrics of the api process (prometheus-client; jax-free).

Served over HTTP (``/metrics``) on ``--metrics-port``. Names follow vLLM's
where one exists (``vllm:`` becomes ``jaxserve_``). The metrics read from the
engines (†) and the routing metrics carry a ``replica`` label, the
data-parallel replica's index (``replica="0"`` in a plain server); a total is
their sum (``sum(jaxserve_num_requests_running)``; for the KV cache usage,
weigh each replica by its blocks, which are equal when the replicas are):

| metric | type | meaning |
|---|---|---|
| ``jaxserve_num_requests_waiting`` † | gauge | sequences waiting in the engine |
| ``jaxserve_num_requests_running`` † | gauge | sequences running in the engine |
| ``jaxserve_num_sequences_in_flight`` | gauge | sequences admitted by the api and not finished (the bound is ``data_parallel_size * max_num_seqs + max_waiting_requests``) |
| ``jaxserve_kv_cache_usage_perc`` † | gauge | KV blocks held by running sequences / all blocks (0..1) |
| ``jaxserve_prefix_cache_hit_rate`` † | gauge | prompt tokens found in the prefix cache / looked up, since start (0..1) |
| ``jaxserve_replica_requests_in_flight`` | gauge | requests the api has in flight on the replica (what routing balances) |
| ``jaxserve_replica_requests_total`` | counter | requests the api routed to the replica |
| ``jaxserve_time_to_first_token_seconds`` | histogram | arrival at the api -> first generated token |
| ``jaxserve_time_per_output_token_seconds`` | histogram | per completion: (finish - first token) / (tokens - 1) |
| ``jaxserve_e2e_request_latency_seconds`` | histogram | arrival -> last completion finished |
| ``jaxserve_generation_tokens_total`` | counter | generated tokens |
| ``jaxserve_prompt_tokens_total`` | counter | prompt tokens of admitted requests |
| ``jaxserve_request_success_total`` | counter | finished completions, by ``finished_reason`` |
| ``jaxserve_requests_rejected_total`` | counter | requests refused, by gRPC ``code`` |
| ``jaxserve_recompiles_after_warmup_total`` † | counter | worker compiles after start-up warm-up (0 when healthy) |
| ``jaxserve_worker_restarts_total`` † | counter | worker processes the engine started to replace a dead or hung one |
| ``jaxserve_spec_decode_num_drafts_total`` † | counter | sequences whose draft tokens a step verified (speculative decoding) |
| ``jaxserve_spec_decode_num_draft_tokens_total`` † | counter | draft tokens verified |
| ``jaxserve_spec_decode_num_accepted_tokens_total`` † | counter | draft tokens accepted (acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts) |

The † metrics read each engine's latest ``EngineStats`` (refreshed by the api
process about once a second) when Prometheus scrapes; a replica has none
before its first snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxserve.engine.messages import EngineStats

# Latency buckets in seconds (vLLM's TTFT / TPOT / e2e ladders, trimmed).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


# name, type, help, value from one replica's EngineStats
_ENGINE_METRICS: tuple[tuple[str, type, str, Callable[[EngineStats], float]], ...] = (
    ("jaxserve_num_requests_waiting", GaugeMetricFamily, "Sequences waiting in the engine.",
     lambda s: s.num_waiting),
    ("jaxserve_num_requests_running", GaugeMetricFamily, "Sequences running in the engine.",
     lambda s: s.num_running),
    ("jaxserve_kv_cache_usage_perc", GaugeMetricFamily,
     "KV blocks held by running sequences / all blocks (0..1).",
     lambda s: s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0),
    ("jaxserve_prefix_cache_hit_rate", GaugeMetricFamily,
     "Prompt tokens found in the prefix cache / looked up (0..1).",
     lambda s: s.prefix_cache_hit_rate),
    ("jaxserve_recompiles_after_warmup", CounterMetricFamily,
     "Worker compiles after start-up warm-up (0 when healthy).", lambda s: s.num_recompiles),
    ("jaxserve_worker_restarts", CounterMetricFamily,
     "Worker processes started to replace a dead or hung one.",
     lambda s: s.num_worker_restarts),
    ("jaxserve_spec_decode_num_drafts", CounterMetricFamily,
     "Sequences whose draft tokens a step verified.", lambda s: s.spec_decode_num_drafts),
    ("jaxserve_spec_decode_num_draft_tokens", CounterMetricFamily, "Draft tokens verified.",
     lambda s: s.spec_decode_num_draft_tokens),
    ("jaxserve_spec_decode_num_accepted_tokens", CounterMetricFamily, "Draft tokens accepted.",
     lambda s: s.spec_decode_num_accepted_tokens),
)


class _EngineStatsCollector(Collector):
    """Per-replica metrics from each engine's latest stats and the api's routing."""

    def __init__(self, get_stats: Callable[[], Sequence[EngineStats | None]],
                 get_in_flight: Callable[[], int],
                 get_routing: Callable[[], tuple[Sequence[int], Sequence[int]]] | None) -> None:
        self._get_stats = get_stats
        self._get_in_flight = get_in_flight
        self._get_routing = get_routing

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("jaxserve_num_sequences_in_flight",
                                "Sequences admitted by the api and not finished.",
                                value=self._get_in_flight())
        if self._get_routing is not None:
            in_flight, routed = self._get_routing()
            gauge = GaugeMetricFamily("jaxserve_replica_requests_in_flight",
                                      "Requests the api has in flight on the replica.",
                                      labels=["replica"])
            counter = CounterMetricFamily("jaxserve_replica_requests",
                                          "Requests the api routed to the replica.",
                                          labels=["replica"])
            for replica, (now, total) in enumerate(zip(in_flight, routed)):
                gauge.add_metric([str(replica)], now)
                counter.add_metric([str(replica)], total)
            yield gauge
            yield counter
        stats = [(str(i), s) for i, s in enumerate(self._get_stats()) if s is not None]
        if not stats:
            return
        for name, family_type, documentation, value in _ENGINE_METRICS:
            family = family_type(name, documentation, labels=["replica"])
            for replica, s in stats:
                family.add_metric([replica], value(s))
            yield family


class ServerMetrics:
    """The api process's metrics, in their own registry.

    Args:
      get_stats: returns each replica's latest ``EngineStats`` (or None), replica 0 first.
      get_in_flight: returns the sequences the api has admitted and not finished.
      get_routing: returns (requests in flight, requests routed) per replica
        (``ReplicaRouter.in_flight``, ``.routed``); None: no routing metrics.
    """

    def __init__(self, get_stats: Callable[[], Sequence[EngineStats | None]],
                 get_in_flight: Callable[[], int] = lambda: 0,
                 get_routing: Callable[[], tuple[Sequence[int], Sequence[int]]] | None = None
                 ) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds",
                              "Arrival at the api -> first generated token.",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("jaxserve_time_per_output_token_seconds",
                              "Per completion: (finish - first token) / (tokens - 1).",
                              buckets=TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds",
                             "Arrival -> last completion finished.", buckets=E2E_BUCKETS,
                             registry=reg)
        self.generation_tokens = Counter("jaxserve_generation_tokens",
                                         "Generated tokens.", registry=reg)
        self.prompt_tokens = Counter("jaxserve_prompt_tokens",
                                     "Prompt tokens of admitted requests.", registry=reg)
        self.finished = Counter("jaxserve_request_success", "Finished completions.",
                                ["finished_reason"], registry=reg)
        self.rejected = Counter("jaxserve_requests_rejected", "Requests refused.", ["code"],
                                registry=reg)
        reg.register(_EngineStatsCollector(get_stats, get_in_flight, get_routing))

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serves ``/metrics`` over HTTP on a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)

    def observe_request(self, arrival: float, first_token: float | None, end: float,
                        completions: list[tuple[int, float | None, float | None, str | None]]
                        ) -> None:
        """Records a finished request (times from ``time.monotonic()``).

        Args:
          completions: (tokens, first token time, finish time, finish reason)
            per finished completion (``RequestTracker.completion_stats``).
        """
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
        self.e2e.observe(end - arrival)
        for tokens, first, finish, reason in completions:
            if tokens > 1 and first is not None and finish is not None:
                self.tpot.observe((finish - first) / (tokens - 1))
            if reason is not None:
                self.finished.labels(finished_reason=reason).inc()
