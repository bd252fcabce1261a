"""Every prefix-cache miss says why, each reason produced on purpose: on the request's span, as a
metric label and as a count in GetInfo; hit-rate totals in tokens (prefix_cache_queries / _hits).
Real workers, a real cache service and a real Redis."""

from __future__ import annotations

import random

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from cache_svc import keys
from gpu_worker.engine.observer import FanOut
from gpu_worker.observers.metrics import MetricsObserver
from gpu_worker.observers.tracing import TracingObserver
from hybridserve.metrics import WorkerMetrics
from scheduler_svc.core import MambaCacheMode, SchedulerConfig
from tests.cache.served import serve

__all__ = ["serve"]

BLOCK = 16
CONFIG = SchedulerConfig(
    max_num_batched_tokens=128, max_num_seqs=4, block_size=BLOCK, mamba_block_size=8, kv_page_size=4,
    mamba_cache_mode=MambaCacheMode.NONE,
)  # fmt: skip


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 120) for _ in range(n)]


def reasons(worker) -> dict[str, int]:
    return dict(worker.info().prefix_cache_miss_reasons)


def test_no_entry_on_every_surface_and_hit_rate_in_tokens(serve, checkpoint, monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")
    exporter, provider, registry = InMemorySpanExporter(), TracerProvider(), CollectorRegistry()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = FanOut([TracingObserver(provider), MetricsObserver(WorkerMetrics(registry))])
    worker = serve(checkpoint, CONFIG, prefix_caching=True, observer=observer)
    prompt = tokens(2 * BLOCK + 3, 1)
    worker.run(prompt)
    worker.run(prompt[: 2 * BLOCK] + tokens(4, 2))  # hits 2 blocks, nothing missed past them
    info = worker.info()
    assert dict(info.prefix_cache_miss_reasons) == {"no_entry": 1}
    assert (info.prefix_cache_queries, info.prefix_cache_hits) == (4 * BLOCK, 2 * BLOCK)
    assert registry.get_sample_value("hybridserve_prefix_cache_misses_total", {"reason": "no_entry"}) == 1
    assert registry.get_sample_value("hybridserve_prefix_cache_queries_total", {"model_name": ""}) == 4 * BLOCK
    assert registry.get_sample_value("hybridserve_prefix_cache_hits_total", {"model_name": ""}) == 2 * BLOCK
    provider.force_flush()
    spans = [s for s in exporter.get_finished_spans() if "hybridserve.cache.miss_reason" in (s.attributes or {})]
    assert [s.attributes["hybridserve.cache.miss_reason"] for s in spans] == ["no_entry", "none"]
    assert [s.attributes["hybridserve.cache.hit_tokens"] for s in spans] == [0, 2 * BLOCK]


def test_kv_without_state_and_evicted(serve, checkpoint):
    """One checkpoint slot: a 4-block prompt keeps state only at its deepest boundary (blocks 1-3 are
    KV-only), and a second prompt's state evicts the first's."""
    worker = serve(checkpoint, CONFIG, prefix_caching=True, num_checkpoint_slots=1)
    first = tokens(4 * BLOCK + 3, 3)
    worker.run(first)
    assert worker.run(first[: 2 * BLOCK + 5] + tokens(3, 4))[2] == 0
    assert reasons(worker) == {"no_entry": 1, "kv_without_state": 1}
    worker.run(tokens(4 * BLOCK + 3, 5))  # takes the only checkpoint slot
    assert worker.run(first[: 4 * BLOCK + 1] + tokens(3, 6))[2] == 0
    assert reasons(worker) == {"no_entry": 2, "kv_without_state": 1, "evicted": 1}


def publish_then_damage(serve, checkpoint, cache_service, redis_server, how: str, observer=None):
    first = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=cache_service.address)
    prompt = tokens(3 * BLOCK + 3, 7)
    first.run(prompt)
    assert first.engine.prefix.shared.flush()
    client = redis_server.client()
    for key in client.scan_iter(keys.block_key_pattern("hybridserve")):
        data = client.hget(key, keys.FIELD_DATA)
        if how == "flip":
            damaged = bytearray(data)
            damaged[len(damaged) // 2] ^= 0x55
            client.hset(key, keys.FIELD_DATA, bytes(damaged))
        elif how == "foreign":  # the tier says the entry is another model's
            client.hset(key, keys.FIELD_FINGERPRINT, "0" * 64)
    second = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=cache_service.address, observer=observer)
    return second, prompt[: 3 * BLOCK] + tokens(5, 8)


@pytest.mark.parametrize(("how", "reason"), [("flip", "failed_verification"), ("foreign", "foreign_fingerprint")])
def test_damaged_or_foreign_checkpoints_in_the_shared_tier(serve, checkpoint, cache_service, redis_server, how, reason):
    worker, prompt = publish_then_damage(serve, checkpoint, cache_service, redis_server, how)
    assert worker.run(prompt)[2] == 0
    assert reasons(worker) == {reason: 1}


def test_shared_tier_down(serve, checkpoint, cache_service, redis_server):
    worker = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=cache_service.address)
    redis_server.kill()
    worker.run(tokens(2 * BLOCK + 3, 9))
    assert reasons(worker) == {"shared_tier_down": 1}


def test_fetch_slower_than_recompute_declines_the_hit_and_reports_it_apart(
    serve, checkpoint, cache_service, redis_server, monkeypatch
):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    worker, prompt = publish_then_damage(
        serve, checkpoint, cache_service, redis_server, "none", TracingObserver(provider)
    )
    worker.engine.prefix.fetch_policy.record_fetch(1000, 10.0)  # a measured 100 B/s link
    worker.engine.prefix.fetch_policy.record_prefill(1_000_000, 1.0)  # and a fast prefill
    assert worker.run(prompt)[2] == 0
    info = worker.info()
    assert dict(info.prefix_cache_miss_reasons) == {"fetch_slower_than_recompute": 1}
    assert info.prefix_cache_declined_tokens == 3 * BLOCK
    fast = publish_then_damage(serve, checkpoint, cache_service, redis_server, "none", TracingObserver(provider))[0]
    assert fast.run(prompt)[2] == 3 * BLOCK, "unmeasured, the worker fetches"
    provider.force_flush()
    decisions = [s.attributes.get("hybridserve.cache.shared.decision") for s in exporter.get_finished_spans()]
    assert [d for d in decisions if d] == ["recompute", "fetch"]
