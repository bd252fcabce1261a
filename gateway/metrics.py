"""The gateway's Prometheus metrics, on its own registry (served at GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
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
        self.ttft_seconds = Histogram(
            "hybridserve_gateway_ttft_seconds", "Request arrival to first token", buckets=_LATENCY_BUCKETS_S, registry=r
        )
        self.in_flight = Gauge("hybridserve_gateway_in_flight_requests", "Requests open at the gateway", registry=r)
        self.workers_ready = Gauge("hybridserve_gateway_workers_ready", "Workers in rotation", registry=r)
        self.cached_tokens = Counter(
            "hybridserve_gateway_cached_prompt_tokens_total",
            "Prompt tokens served from a worker's prefix cache",
            registry=r,
        )
        self.prompt_tokens = Counter("hybridserve_gateway_prompt_tokens_total", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("hybridserve_gateway_completion_tokens_total", "Generated tokens", registry=r)

    def routed(self, worker: str, prefix_hit: bool) -> None:
        self.routed_requests.labels(worker, "true" if prefix_hit else "false").inc()

    def retried(self, code: str) -> None:
        self.retries.labels(code).inc()

    def finished(self, route: str, status: int | str) -> None:
        self.requests.labels(route, str(status)).inc()

    def usage(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.completion_tokens.inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
