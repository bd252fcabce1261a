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

from hybridserve.errors import InvalidArgumentError

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


# vLLM's serving series (vllm/v1/metrics/loggers.py), kept under our prefix with vLLM's meaning and a
# model_name label; --metrics-compat vllm serves each a second time under "vllm:" + the same suffix.
VLLM_SERIES = (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens", "generation_tokens",
    "request_success", "num_preemptions", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens",
    "prefix_cache_queries", "prefix_cache_hits", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
)  # fmt: skip
METRICS_COMPAT = ("", "vllm")
METRICS_COMPAT_HELP = "vllm: serve vLLM's series also under vLLM's own vllm: names (its dashboards, autoscalers)"
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                              120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip  # vLLM's
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip  # vLLM's
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip  # vLLM's


class CompatCollector:
    """Serves metric objects a second time under another prefix ("hybridserve_x" -> "vllm:x"), read at
    scrape time from the same values, so the two names never disagree."""

    def __init__(self, metrics: list[Any], old_prefix: str, new_prefix: str) -> None:
        self._metrics, self._old, self._new = metrics, old_prefix, new_prefix

    def collect(self) -> Any:
        for metric in self._metrics:
            for family in metric.collect():
                family.name = self._new + family.name.removeprefix(self._old)
                family.samples = [s._replace(name=self._new + s.name.removeprefix(self._old)) for s in family.samples]
                yield family

    def describe(self) -> list[Any]:
        return []  # collected only at scrape time: the registry never checks these names for clashes


def check_metrics_compat(compat: str) -> str:
    if compat not in METRICS_COMPAT:
        raise InvalidArgumentError(f"--metrics-compat must be '' or 'vllm', got {compat!r}")
    return compat


class WorkerMetrics:
    """What the engine exposes: vLLM's serving series (VLLM_SERIES, labelled with model_name), then our
    own: plan and step latency, tokens by kind, pool use, cache tiers and miss reasons, stalls."""

    def __init__(self, registry: CollectorRegistry, model_name: str = "", compat: str = "") -> None:
        check_metrics_compat(compat)
        self.model_name = model_name
        vllm: list[Any] = []

        def series(kind: type, name: str, text: str, labels: tuple[str, ...] = (), **kw: Any) -> Any:
            metric = kind(f"hybridserve_{name}", text, ["model_name", *labels], registry=registry, **kw)
            vllm.append(metric)
            return metric if labels else metric.labels(model_name)

        def histogram(name: str, text: str, labels: list[str] | None = None, **kw: Any) -> Histogram:
            return Histogram(name, text, labels or [], registry=registry, **kw)

        self.running = series(Gauge, "num_requests_running", "requests holding pages and a state slot")
        self.waiting = series(Gauge, "num_requests_waiting", "requests queued, not admitted")
        self.kv_cache_usage = series(Gauge, "kv_cache_usage_perc", "KV pages in use / in the pool (1 = full)")
        self.prompt_tokens = series(Counter, "prompt_tokens", "prompt tokens of finished requests")
        self.output_tokens = series(Counter, "generation_tokens", "tokens generated")
        self.request_success = series(Counter, "request_success", "finished requests", ("finished_reason",))
        self.preemptions = series(Counter, "num_preemptions", "requests preempted (by plans or for lack of pages)")
        self.ttft = series(Histogram, "time_to_first_token_seconds", "arrival to first token", buckets=TTFT_BUCKETS_S)
        self.itl = series(Histogram, "inter_token_latency_seconds", "between output tokens", buckets=ITL_BUCKETS_S)
        self.e2e = series(Histogram, "e2e_request_latency_seconds", "arrival to finish",
                          buckets=REQUEST_LATENCY_BUCKETS_S)  # fmt: skip
        self.queue_time = series(Histogram, "request_queue_time_seconds", "arrival to first scheduled",
                                 buckets=REQUEST_LATENCY_BUCKETS_S)  # fmt: skip
        self.prefill_time = series(Histogram, "request_prefill_time_seconds", "first scheduled to first token",
                                   buckets=REQUEST_LATENCY_BUCKETS_S)  # fmt: skip
        self.decode_time = series(Histogram, "request_decode_time_seconds", "first token to last token",
                                  buckets=REQUEST_LATENCY_BUCKETS_S)  # fmt: skip
        self.iteration_tokens = series(Histogram, "iteration_tokens_total", "tokens computed in one engine step",
                                       buckets=_TOKEN_BUCKETS)  # fmt: skip
        self.request_prompt_tokens = series(Histogram, "request_prompt_tokens", "prompt tokens per finished request",
                                            buckets=_TOKEN_BUCKETS)  # fmt: skip
        self.request_generation_tokens = series(Histogram, "request_generation_tokens", "generated tokens per"
                                                " finished request", buckets=_TOKEN_BUCKETS)  # fmt: skip
        self.prefix_cache_queries = series(Counter, "prefix_cache_queries", "prefix cache lookups, in prompt tokens")
        self.prefix_cache_hits = series(Counter, "prefix_cache_hits", "of those tokens, served from the cache")
        self.spec_drafts = series(Counter, "spec_decode_num_drafts", "speculative decoding: rows verified with drafts")
        self.spec_draft_tokens = series(Counter, "spec_decode_num_draft_tokens", "draft tokens verified")
        self.spec_accepted_tokens = series(Counter, "spec_decode_num_accepted_tokens", "draft tokens accepted")
        self.spec_accepted_per_pos = series(
            Counter, "spec_decode_num_accepted_tokens_per_pos", "draft tokens accepted at each draft position",
            ("position",),
        )  # fmt: skip
        if compat == "vllm":
            registry.register(CompatCollector(vllm, "hybridserve_", "vllm:"))
        self.plan_latency = histogram(
            "hybridserve_plan_latency_seconds", "PlanStep round trip", buckets=_LATENCY_BUCKETS_S
        )
        self.step_seconds = histogram("hybridserve_step_seconds", "whole engine step", buckets=_LATENCY_BUCKETS_S)
        self.step_tokens = histogram(
            "hybridserve_step_batch_tokens", "tokens computed in one step, by kind", ["kind"], buckets=_TOKEN_BUCKETS
        )
        self.tokens = Counter("hybridserve_computed_tokens", "tokens computed, by kind", ["kind"], registry=registry)
        self.cached_prompt_tokens = Counter(
            "hybridserve_cached_prompt_tokens", "prompt tokens served from a prefix cache", registry=registry
        )
        self.cache_lookups = Counter(
            "hybridserve_cache_lookups", "prefix cache lookups, by tier and result", ["tier", "result"],
            registry=registry,
        )  # fmt: skip
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
