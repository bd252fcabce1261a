"""Prometheus metrics: one registry per process, served over HTTP on `--metrics-port`.

Metric families are small classes bound to a registry (the process one by default, a fresh one in
tests), so two engines in one test process never collide. Names carry their units (`_seconds`,
`_tokens`, `_total`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("hybridserve.metrics")

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

_lock = threading.Lock()
_process_registry: CollectorRegistry | None = None  # set once a metrics server runs in this process
_rpc_metrics: dict[int, RpcMetrics] = {}


def process_registry() -> CollectorRegistry | None:
    """The registry served by this process's metrics endpoint; None while metrics are off."""
    return _process_registry


def start_metrics_server(port: int, host: str = "0.0.0.0") -> tuple[CollectorRegistry, int]:
    """Serves the process registry on http://host:port/metrics (port 0 picks a free one) and prints
    `metrics on HOST:PORT`. Returns the registry and the bound port."""
    global _process_registry
    with _lock:
        if _process_registry is None:
            _process_registry = CollectorRegistry()
        registry = _process_registry
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    bound = int(httpd.server_port)
    print(f"metrics on {host}:{bound}", flush=True)
    return registry, bound


def rpc_metrics(registry: CollectorRegistry | None = None) -> RpcMetrics | None:
    """The RPC metrics of `registry` (default: the process one), created once per registry."""
    registry = registry or _process_registry
    if registry is None:
        return None
    with _lock:
        found = _rpc_metrics.get(id(registry))
        if found is None:
            found = _rpc_metrics[id(registry)] = RpcMetrics(registry)
        return found


class RpcMetrics:
    """Per-call latency and failures, by side (server, client), method and status code."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Histogram(
            "hybridserve_rpc_seconds",
            "gRPC call latency",
            ["side", "method"],
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.errors = Counter(
            "hybridserve_rpc_errors", "gRPC calls that ended with a non-OK status", ["side", "method", "code"],
            registry=registry,
        )  # fmt: skip

    def observe(self, side: str, method: str, code: str, seconds: float) -> None:
        self.seconds.labels(side, method).observe(seconds)
        if code != "OK":
            self.errors.labels(side, method, code).inc()


class WorkerMetrics:
    """What the engine exposes: latencies, tokens by kind, queue and pool use, cache and stalls."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, text: str, labels: list[str] | None = None, **kw: Any) -> Histogram:
            return Histogram(name, text, labels or [], registry=registry, **kw)

        self.ttft = histogram(
            "hybridserve_time_to_first_token_seconds", "arrival to first token", buckets=_LATENCY_BUCKETS_S
        )
        self.itl = histogram(
            "hybridserve_inter_token_latency_seconds", "between output tokens", buckets=_LATENCY_BUCKETS_S
        )
        self.e2e = histogram("hybridserve_request_seconds", "arrival to finish", buckets=_LATENCY_BUCKETS_S)
        self.plan_latency = histogram(
            "hybridserve_plan_latency_seconds", "PlanStep round trip", buckets=_LATENCY_BUCKETS_S
        )
        self.step_seconds = histogram("hybridserve_step_seconds", "whole engine step", buckets=_LATENCY_BUCKETS_S)
        self.step_tokens = histogram(
            "hybridserve_step_batch_tokens", "tokens computed in one step, by kind", ["kind"], buckets=_TOKEN_BUCKETS
        )
        self.tokens = Counter("hybridserve_computed_tokens", "tokens computed, by kind", ["kind"], registry=registry)
        self.output_tokens = Counter("hybridserve_output_tokens", "tokens generated", registry=registry)
        self.requests = Counter("hybridserve_requests", "finished requests, by reason", ["reason"], registry=registry)
        self.cached_prompt_tokens = Counter(
            "hybridserve_cached_prompt_tokens", "prompt tokens served from a prefix cache", registry=registry
        )
        self.cache_lookups = Counter(
            "hybridserve_cache_lookups", "prefix cache lookups, by tier and result", ["tier", "result"],
            registry=registry,
        )  # fmt: skip
        self.prefix_cache_queries = Counter(
            "hybridserve_prefix_cache_queries", "prefix cache lookups, in tokens (as vLLM's)", registry=registry
        )
        self.prefix_cache_hits = Counter(
            "hybridserve_prefix_cache_hits", "of those tokens, served from the cache (as vLLM's)", registry=registry
        )
        self.cache_misses = Counter(
            "hybridserve_prefix_cache_misses", "lookups that stopped short, by reason", ["reason"], registry=registry
        )
        self.cache_fetch_decisions = Counter(
            "hybridserve_prefix_cache_fetch_decisions", "shared-tier blocks fetched or recomputed", ["decision"],
            registry=registry,
        )  # fmt: skip
        self.steps = Counter("hybridserve_steps", "engine steps", registry=registry)
        self.stalled_steps = Counter(
            "hybridserve_stalled_steps", "steps where pending prefills got nothing", registry=registry
        )
        self.preemptions = Counter("hybridserve_preemptions", "requests preempted by plans", registry=registry)
        self.queue_depth = Gauge("hybridserve_queue_depth", "waiting requests", registry=registry)
        self.running = Gauge("hybridserve_running_requests", "requests holding pages and a slot", registry=registry)
        self.kv_pages_used = Gauge("hybridserve_kv_pages_used", "KV pages in use", registry=registry)
        self.kv_pages_total = Gauge("hybridserve_kv_pages_total", "KV pages in the pool", registry=registry)
        self.state_slots_used = Gauge("hybridserve_state_slots_used", "Mamba state slots in use", registry=registry)
        self.state_slots_total = Gauge("hybridserve_state_slots_total", "Mamba state slots", registry=registry)

    def record_cache_lookup(
        self,
        tier: str,
        hit: bool,
        query_tokens: int = 0,
        hit_tokens: int = 0,
        miss_reason: str = "",
        decision: str = "",
    ) -> None:
        """For the prefix cache (tier "worker" or "shared"). Token counts and miss reasons come
        from the worker-tier lookup (a request's outcome); the fetch decision from the shared one."""
        self.cache_lookups.labels(tier, "hit" if hit else "miss").inc()
        if tier == "worker":
            self.prefix_cache_queries.inc(query_tokens)
            self.prefix_cache_hits.inc(hit_tokens)
            if miss_reason:
                self.cache_misses.labels(miss_reason).inc()
        if decision:
            self.cache_fetch_decisions.labels(decision).inc()
