"""Prometheus metrics as an observer: latencies, tokens by kind, queue and pool use, cache lookups,
stalls and preemptions, all from the engine's records."""

from __future__ import annotations

from gpu_worker.engine.observer import EngineObserver
from gpu_worker.engine.records import CacheLookup, FirstToken, Occupancy, RequestFinished, StepRecord
from hybridserve.metrics import WorkerMetrics


class MetricsObserver(EngineObserver):
    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (output tokens counted, time of the last)

    def request_first_token(self, event: FirstToken) -> None:
        self.metrics.ttft.observe(event.first_token_time - event.arrival_time)

    def request_finished(self, event: RequestFinished) -> None:
        m = self.metrics
        m.requests.labels(event.reason.value).inc()
        m.e2e.observe(event.finish_time - event.arrival_time)
        m.cached_prompt_tokens.inc(event.num_cached_tokens)
        self._seen.pop(event.request_id, None)

    def cache_lookup(self, event: CacheLookup) -> None:
        self.metrics.record_cache_lookup(
            event.tier, event.hit, event.num_query_tokens, event.num_hit_tokens, event.miss_reason, event.decision
        )

    def occupancy_changed(self, occupancy: Occupancy) -> None:
        m, o = self.metrics, occupancy
        m.queue_depth.set(o.num_waiting)
        m.running.set(o.num_running)
        m.kv_pages_used.set(o.num_kv_pages_used)
        m.kv_pages_total.set(o.num_kv_pages_total)
        m.state_slots_used.set(o.num_state_slots_used)
        m.state_slots_total.set(o.num_state_slots_total)

    def step_finished(self, record: StepRecord) -> None:
        m = self.metrics
        for s in record.served:
            if s.sampled:
                self._count_outputs(s.request_id, s.num_output_tokens, record.end_time_s)
        for kind, n in (("prefill", record.num_prefill_tokens), ("decode", record.num_decode_tokens)):
            m.step_tokens.labels(kind).observe(n)
            if n:
                m.tokens.labels(kind).inc(n)
        m.steps.inc()
        m.plan_latency.observe(record.plan_latency_s)
        m.step_seconds.observe(record.wall_s)
        if record.plan.stats.stalled:
            m.stalled_steps.inc()
        if record.plan.preempted_request_ids:
            m.preemptions.inc(len(record.plan.preempted_request_ids))
        self.occupancy_changed(record.occupancy)

    def _count_outputs(self, request_id: str, count: int, now: float) -> None:
        """Counts a request's new output tokens and, after its first, their inter-token latency."""
        prev_count, prev_time = self._seen.get(request_id, (0, -1.0))
        if count <= prev_count:
            return
        self.metrics.output_tokens.inc(count - prev_count)
        if prev_count > 0:
            gap = (now - prev_time) / (count - prev_count)
            for _ in range(count - prev_count):
                self.metrics.itl.observe(gap)
        self._seen[request_id] = (count, now)
