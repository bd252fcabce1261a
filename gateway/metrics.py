"""The gateway's Prometheus metrics, on its own registry (served at GET /metrics).

vLLM's request series as the client-facing side sees them (GATEWAY_VLLM_SERIES: TTFT, inter-token
latency and end-to-end latency histograms, token counters and outcomes, each labelled with
model_name; queue and KV series are the workers'), then the gateway's own (routing, retries, workers in rotation). With
--metrics-compat vllm the former are served again under vLLM's vllm: names."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hybridserve.metrics import (
    ITL_BUCKETS_S,
    REQUEST_LATENCY_BUCKETS_S,
    TTFT_BUCKETS_S,
    CompatCollector,
    check_metrics_compat,
)

GATEWAY_VLLM_SERIES = (
    "prompt_tokens", "generation_tokens", "request_success", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds",
)  # fmt: skip


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, compat: str = "") -> None:
        check_metrics_compat(compat)
        self.registry = registry or CollectorRegistry()
        r = self.registry
        labels = ["model_name"]
        self.prompt_tokens = Counter("hybridserve_gateway_prompt_tokens", "Prompt tokens", labels, registry=r)
        self.generation_tokens = Counter("hybridserve_gateway_generation_tokens", "Generated tokens", labels,
                                         registry=r)  # fmt: skip
        self.request_success = Counter("hybridserve_gateway_request_success", "Finished generation requests",
                                       ["model_name", "finished_reason"], registry=r)  # fmt: skip
        self.ttft_seconds = Histogram("hybridserve_gateway_time_to_first_token_seconds", "Arrival to first token",
                                      labels, buckets=TTFT_BUCKETS_S, registry=r)  # fmt: skip
        self.itl_seconds = Histogram("hybridserve_gateway_inter_token_latency_seconds", "Between streamed tokens",
                                     labels, buckets=ITL_BUCKETS_S, registry=r)  # fmt: skip
        self.e2e_seconds = Histogram("hybridserve_gateway_e2e_request_latency_seconds", "Request arrival to its end",
                                     labels, buckets=REQUEST_LATENCY_BUCKETS_S, registry=r)  # fmt: skip
        if compat == "vllm":
            series = [self.prompt_tokens, self.generation_tokens, self.request_success,
                      self.ttft_seconds, self.itl_seconds, self.e2e_seconds]  # fmt: skip
            r.register(CompatCollector(series, "hybridserve_gateway_", "vllm:"))
        self.requests = Counter(
            "hybridserve_gateway_requests_total",
            "HTTP and gRPC requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.routed_requests = Counter(
            "hybridserve_gateway_routed_total",
            "Requests sent to a worker, by whether the gateway had sent it the prompt's leading block before",
            ["worker", "prefix_hit"],
            registry=r,
        )
        self.retries = Counter(
            "hybridserve_gateway_retries_total",
            "Requests retried on another worker before their first token, by the failed call's status",
            ["code"],
            registry=r,
        )
        self.in_flight = Gauge("hybridserve_gateway_in_flight_requests", "Requests open at the gateway", registry=r)
        self.workers_ready = Gauge("hybridserve_gateway_workers_ready", "Workers in rotation", registry=r)
        self.cached_tokens = Counter(
            "hybridserve_gateway_cached_prompt_tokens_total",
            "Prompt tokens served from a worker's prefix cache",
            registry=r,
        )

    def routed(self, worker: str, prefix_hit: bool) -> None:
        self.routed_requests.labels(worker, "true" if prefix_hit else "false").inc()

    def retried(self, code: str) -> None:
        self.retries.labels(code).inc()

    def finished(self, route: str, status: int | str) -> None:
        self.requests.labels(route, str(status)).inc()

    def clock(self, model: str, started_s: float) -> RequestClock:
        """The timing of one generation request that arrived at `started_s` (perf_counter)."""
        return RequestClock(self, model, started_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestClock:
    """One generation request at the gateway: tokens as they are streamed, then its end. A message
    of n tokens spreads its gap over them, as the worker counts ITL per token."""

    def __init__(self, metrics: GatewayMetrics, model: str, started_s: float) -> None:
        self._m, self.model, self.started_s = metrics, model, started_s
        self._last_s: float | None = None
        self._done = False

    def tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        if self._last_s is None:
            self._m.ttft_seconds.labels(self.model).observe(now - self.started_s)
        else:
            gap = (now - self._last_s) / num_tokens
            itl = self._m.itl_seconds.labels(self.model)
            for _ in range(num_tokens):
                itl.observe(gap)
        self._last_s = now

    def finished(self, reason: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
        """The request ended with `reason` ("stop", "length", ... or "error", "abort"); once."""
        if self._done:
            return
        self._done = True
        m = self._m
        m.e2e_seconds.labels(self.model).observe(time.perf_counter() - self.started_s)
        m.request_success.labels(self.model, reason or "abort").inc()
        m.prompt_tokens.labels(self.model).inc(prompt_tokens)
        m.generation_tokens.labels(self.model).inc(completion_tokens)
        m.cached_tokens.inc(cached_tokens)
