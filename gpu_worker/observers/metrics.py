"""Prometheus metrics as an observer: vLLM's serving series (latencies, queue / prefill / decode
time, tokens, request outcomes, queue and KV use, prefix-cache tokens) and ours (plan and step
latency, pools, cache tiers, stalls), all from the engine's records.

A request's phases, as vLLM splits them (times from the records):
    queue    arrival -> the start of the first step that computed any of its tokens
    prefill  that start -> its first token
    decode   first token -> its last token (the finish)
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.engine.observer import EngineObserver
from gpu_worker.engine.records import CacheLookup, FirstToken, Occupancy, RequestFinished, StepRecord
from hybridserve.metrics import WorkerMetrics


@dataclass(slots=True)
class _Progress:
    """What the observer tracks of one live request."""

    scheduled_s: float | None = None  # start of its first step
    first_token_s: float | None = None
    num_output_tokens: int = 0  # counted so far
    last_token_s: float = -1.0  # when the last counted token was applied


class MetricsObserver(EngineObserver):
    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self._live: dict[str, _Progress] = {}

    def request_first_token(self, event: FirstToken) -> None:
        self.metrics.ttft.observe(event.first_token_time - event.arrival_time)
        self._live.setdefault(event.request_id, _Progress()).first_token_s = event.first_token_time

    def request_finished(self, event: RequestFinished) -> None:
        m = self.metrics
        m.request_success.labels(m.model_name, event.reason.value).inc()
        m.e2e.observe(event.finish_time - event.arrival_time)
        m.cached_prompt_tokens.inc(event.num_cached_tokens)
        m.prompt_tokens.inc(event.num_prompt_tokens)
        m.request_prompt_tokens.observe(event.num_prompt_tokens)
        m.request_generation_tokens.observe(event.num_output_tokens)
        progress = self._live.pop(event.request_id, None)
        if progress is None or progress.scheduled_s is None:
            return  # never ran (rejected, aborted while queued): no phases
        m.queue_time.observe(max(0.0, progress.scheduled_s - event.arrival_time))
        if progress.first_token_s is not None:
            m.prefill_time.observe(max(0.0, progress.first_token_s - progress.scheduled_s))
            m.decode_time.observe(max(0.0, event.finish_time - progress.first_token_s))

    def cache_lookup(self, event: CacheLookup) -> None:
        self.metrics.record_cache_lookup(
            event.tier, event.hit, event.num_query_tokens, event.num_hit_tokens, event.miss_reason, event.decision
        )

    def occupancy_changed(self, occupancy: Occupancy) -> None:
        m, o = self.metrics, occupancy
        m.waiting.set(o.num_waiting)
        m.running.set(o.num_running)
        m.kv_pages_used.set(o.num_kv_pages_used)
        m.kv_pages_total.set(o.num_kv_pages_total)
        m.kv_cache_usage.set(o.num_kv_pages_used / o.num_kv_pages_total if o.num_kv_pages_total else 0.0)
        m.state_slots_used.set(o.num_state_slots_used)
        m.state_slots_total.set(o.num_state_slots_total)

    def step_finished(self, record: StepRecord) -> None:
        m = self.metrics
        step_start_s = record.end_time_s - record.wall_s + record.plan_wait_s  # after the plan arrived
        for s in record.served:
            progress = self._live.get(s.request_id)
            if progress is None:
                progress = self._live[s.request_id] = _Progress()
            if progress.scheduled_s is None:
                progress.scheduled_s = step_start_s
            if s.sampled:
                self._count_outputs(progress, s.num_output_tokens, record.end_time_s)
        for kind, n in (("prefill", record.num_prefill_tokens), ("decode", record.num_decode_tokens)):
            m.step_tokens.labels(kind).observe(n)
            if n:
                m.tokens.labels(kind).inc(n)
        m.iteration_tokens.observe(record.num_computed_tokens)
        m.steps.inc()
        m.plan_latency.observe(record.plan_latency_s)
        m.step_seconds.observe(record.wall_s)
        if record.plan.stats.stalled:
            m.stalled_steps.inc()
        if record.preempted_request_ids:
            m.preemptions.inc(len(record.preempted_request_ids))
        if record.drafts:
            self._count_drafts(record.drafts)
        self.occupancy_changed(record.occupancy)

    def _count_drafts(self, drafts: tuple[tuple[str, int, int], ...]) -> None:
        m = self.metrics
        m.spec_drafts.inc(len(drafts))
        m.spec_draft_tokens.inc(sum(d for _, d, _ in drafts))
        m.spec_accepted_tokens.inc(sum(a for _, _, a in drafts))
        for _, _, accepted in drafts:
            for position in range(accepted):
                m.spec_accepted_per_pos.labels(m.model_name, str(position)).inc()

    def _count_outputs(self, progress: _Progress, count: int, now: float) -> None:
        """Counts a request's new output tokens and, after its first, their inter-token latency."""
        new = count - progress.num_output_tokens
        if new <= 0:
            return
        self.metrics.output_tokens.inc(new)
        if progress.num_output_tokens > 0:
            gap = (now - progress.last_token_s) / new
            for _ in range(new):
                self.metrics.itl.observe(gap)
        progress.num_output_tokens, progress.last_token_s = count, now
