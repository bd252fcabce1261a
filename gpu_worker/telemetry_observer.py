"""The engine observer behind tracing, metrics and step recording (DESIGN §6).

Spans:
- `hybridserve.request`, one per request: opened when it is queued (a child of the Generate server
  span, so of the client's trace), events `first_token`, attributes for the finish reason and
  token counts.
- `hybridserve.step`, one per engine step, the root of its own trace: the plan summary as
  attributes and a **link** to the span of each request the step served. The PlanStep call made
  inside the step (the plan of the next step, with async scheduling) is its child, and the
  scheduler's server span a child of that.

Metrics go to a WorkerMetrics; a StepRecorder, when set, writes the sampled steps' scheduler input
(and, when tracing, adds it to the step span as an event if it is small).

Attributes are read from the plan the engine executed: `requests` are the requests whose slices
ran, so slices of requests that ended before the step (async scheduling) are counted as skipped.
"""

from __future__ import annotations

import argparse
import base64
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from gpu_worker.engine.observer import EngineObserver
from gpu_worker.step_recorder import StepRecorder
from hybridserve import telemetry
from hybridserve.metrics import WorkerMetrics, process_registry
from scheduler_svc.core import StepInput, StepPlan

if TYPE_CHECKING:
    from gpu_worker.engine.engine import Engine
    from gpu_worker.engine.request import Request

MAX_EVENT_INPUT_BYTES = 4096  # a recorded step input larger than this stays in the file only
PREFIX = "hybridserve.step."


class TelemetryObserver(EngineObserver):
    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        metrics: WorkerMetrics | None = None,
        recorder: StepRecorder | None = None,
    ) -> None:
        self._tracer = telemetry.get_tracer(tracer_provider) if telemetry.tracing_enabled(tracer_provider) else None
        self.metrics = metrics
        self.recorder = recorder
        self._request_spans: dict[str, trace.Span] = {}
        self._ended_contexts: dict[str, trace.SpanContext] = {}  # ended this step, still to link
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (output tokens, time of last)
        self._done_ids: set[str] = set()  # finished since the last step_finished
        self._step_span: trace.Span | None = None

    @property
    def is_active(self) -> bool:
        return self._tracer is not None or self.metrics is not None or self.recorder is not None

    def watch(self, engine: Engine) -> None:
        """Points the queue and pool gauges at a running engine (read at scrape time)."""
        m = self.metrics
        if m is None:
            return
        kv, state = engine.runner.kv_pool, engine.runner.state_pool
        m.queue_depth.set_function(lambda: engine.num_waiting)
        m.running.set_function(lambda: engine.num_running)
        m.kv_pages_used.set_function(lambda: kv.num_pages - kv.num_free_pages)
        m.kv_pages_total.set(kv.num_pages)
        m.state_slots_used.set_function(lambda: state.num_slots - state.num_free_slots)
        m.state_slots_total.set(state.num_slots)

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()

    # ---- requests ---------------------------------------------------------------------------------
    def request_queued(self, request: Request) -> None:
        if self.recorder is not None:
            self.recorder.request_queued(request)
        if self._tracer is None:
            return
        span = self._request_spans[request.request_id] = self._tracer.start_span(
            "hybridserve.request",
            kind=SpanKind.INTERNAL,
            attributes={
                "hybridserve.request_id": request.request_id,
                "hybridserve.prompt_tokens": len(request.prompt_token_ids),
                "hybridserve.max_tokens": request.params.max_tokens,
                "hybridserve.priority": request.params.priority,
            },
        )
        request.trace_context = trace.set_span_in_context(span)  # parents the request's cache calls

    def request_first_token(self, request: Request) -> None:
        if self.metrics is not None and request.first_token_time is not None:
            self.metrics.ttft.observe(request.first_token_time - request.arrival_time)
        span = self._request_spans.get(request.request_id)
        if span is not None:
            span.add_event("first_token")

    def request_finished(self, request: Request, reason: str, error: Exception | None) -> None:
        now = time.monotonic()
        rid = request.request_id
        if self.recorder is not None:
            self.recorder.request_finished(request, reason, error)
        if self.metrics is not None:
            self._account_tokens(request, now)
            self.metrics.requests.labels(reason).inc()
            self.metrics.e2e.observe(now - request.arrival_time)
            self.metrics.cached_prompt_tokens.inc(request.num_cached_tokens)
        self._seen.pop(rid, None)
        self._done_ids.add(rid)
        span = self._request_spans.pop(rid, None)
        if span is None:
            return
        usage = request.usage()
        span.set_attribute("hybridserve.finish_reason", reason)
        span.set_attribute("hybridserve.completion_tokens", usage["completion_tokens"])
        span.set_attribute("hybridserve.cached_tokens", usage["cached_tokens"])
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()
        self._ended_contexts[rid] = span.get_span_context()

    def _account_tokens(self, request: Request, now: float) -> None:
        """Counts the request's new output tokens and their inter-token latency."""
        assert self.metrics is not None
        count = len(request.output_token_ids)
        prev_count, prev_time = self._seen.get(request.request_id, (0, -1.0))
        if count > prev_count:
            self.metrics.output_tokens.inc(count - prev_count)
            if prev_count > 0:
                gap = (now - prev_time) / (count - prev_count)
                for _ in range(count - prev_count):
                    self.metrics.itl.observe(gap)
            self._seen[request.request_id] = (count, now)

    def cache_lookup(self, tier: str, hit: bool) -> None:
        if self.metrics is not None:
            self.metrics.record_cache_lookup(tier, hit)

    # ---- steps ------------------------------------------------------------------------------------
    def step(self, step_index: int) -> AbstractContextManager[object]:
        if self._tracer is None:
            return nullcontext()
        return self._traced_step(step_index)

    @contextmanager
    def _traced_step(self, step_index: int) -> Iterator[object]:
        assert self._tracer is not None
        root = otel_context.Context()  # each step is the root of its own trace
        span = self._tracer.start_span("hybridserve.step", context=root, attributes={PREFIX + "index": step_index})
        self._step_span = span
        try:
            with trace.use_span(span, end_on_exit=True):
                yield span
        finally:
            self._step_span = None

    def step_finished(
        self,
        step_index: int,
        step_input: StepInput | None,
        plan: StepPlan,
        requests: list[Request],
        plan_wait_s: float,
        plan_latency_s: float,
        wall_s: float,
    ) -> None:
        summary = summarize(plan, requests)
        recorded = None
        if self.recorder is not None and step_input is not None and self.recorder.should_record():
            recorded = self.recorder.record(step_index, step_input, plan, plan_latency_s, wall_s)
        if self.metrics is not None:
            self._update_metrics(summary, plan, requests, plan_latency_s, wall_s)
        span = self._step_span
        if span is not None and span.is_recording():
            attrs = {PREFIX + k: v for k, v in summary.items()}
            attrs.update(plan_attributes(step_input, plan, plan_wait_s, plan_latency_s, wall_s))
            span.set_attributes(attrs)
            self._link_requests(span, plan, requests)
            if recorded is not None:
                span.add_event("hybridserve.step.input", _input_event(recorded))
        self._ended_contexts.clear()
        self._done_ids.clear()

    def _link_requests(self, span: trace.Span, plan: StepPlan, requests: list[Request]) -> None:
        slices = {s.request_id: s for s in plan.slices}
        for request in requests:
            rid = request.request_id
            live = self._request_spans.get(rid)
            ctx = live.get_span_context() if live is not None else self._ended_contexts.get(rid)
            if ctx is None:
                continue
            s = slices[rid]
            span.add_link(
                ctx,
                {
                    "hybridserve.request_id": rid,
                    "hybridserve.num_tokens": s.num_tokens,
                    "hybridserve.is_prefill": s.is_prefill,
                },
            )

    def _update_metrics(
        self, summary: dict[str, int], plan: StepPlan, requests: list[Request], plan_latency_s: float, wall_s: float
    ) -> None:
        m = self.metrics
        assert m is not None
        now = time.monotonic()
        for request in requests:
            if request.request_id not in self._done_ids:
                self._account_tokens(request, now)
        for kind in ("prefill", "decode"):
            n = summary[f"num_{kind}_tokens"]
            m.step_tokens.labels(kind).observe(n)
            if n:
                m.tokens.labels(kind).inc(n)
        m.steps.inc()
        m.plan_latency.observe(plan_latency_s)
        m.step_seconds.observe(wall_s)
        if plan.stats.stalled:
            m.stalled_steps.inc()
        if plan.preempted_request_ids:
            m.preemptions.inc(len(plan.preempted_request_ids))


def summarize(plan: StepPlan, requests: list[Request]) -> dict[str, int]:
    """What the step executed: tokens and slices by kind over the slices whose request ran."""
    served = {r.request_id for r in requests}
    ran = [s for s in plan.slices if s.request_id in served]
    prefill = [s for s in ran if s.is_prefill]
    decode = [s for s in ran if not s.is_prefill]
    return {
        "num_slices": len(ran),
        "num_prefill_slices": len(prefill),
        "num_decode_slices": len(decode),
        "num_prefill_tokens": sum(s.num_tokens for s in prefill),
        "num_decode_tokens": sum(s.num_tokens for s in decode),
        "budget_used_tokens": sum(s.num_tokens for s in ran),
        "num_skipped_slices": len(plan.slices) - len(ran),
        "num_checkpoint_slices": sum(1 for s in ran if s.ends_on_checkpoint),
    }


def plan_attributes(
    step_input: StepInput | None, plan: StepPlan, plan_wait_s: float, plan_latency_s: float, wall_s: float
) -> dict[str, int | float | bool | str | list[str]]:
    """The plan as the scheduler returned it, and what the scheduler saw."""
    stats = plan.stats
    attrs: dict[str, int | float | bool | str | list[str]] = {
        PREFIX + "quantum": plan.quantum,
        PREFIX + "planned_prefill_tokens": stats.num_prefill_tokens,
        PREFIX + "planned_decode_tokens": stats.num_decode_tokens,
        PREFIX + "prefill_budget_tokens": stats.prefill_budget_tokens,
        PREFIX + "num_pending_prefills": stats.num_pending_prefills,
        PREFIX + "stalled": stats.stalled,
        PREFIX + "micro_sliced": stats.micro_sliced,
        PREFIX + "num_kv_pages_allocated": stats.num_kv_pages_allocated,
        PREFIX + "num_preemptions": len(plan.preempted_request_ids),
        PREFIX + "preempted_request_ids": list(plan.preempted_request_ids),
        PREFIX + "plan_latency_s": plan_latency_s,
        PREFIX + "plan_wait_s": plan_wait_s,
        PREFIX + "wall_s": wall_s,
    }
    if step_input is not None:
        attrs[PREFIX + "planned_index"] = step_input.step_index
        attrs[PREFIX + "max_num_batched_tokens"] = step_input.config.max_num_batched_tokens
        attrs[PREFIX + "num_running"] = len(step_input.running)
        attrs[PREFIX + "num_waiting"] = len(step_input.waiting)
        attrs[PREFIX + "num_free_kv_pages"] = step_input.num_free_kv_pages
    return attrs


def _input_event(request_bytes: bytes) -> dict[str, str | int]:
    if len(request_bytes) > MAX_EVENT_INPUT_BYTES:
        return {"hybridserve.step.input_bytes": len(request_bytes)}
    return {
        "hybridserve.step.input_bytes": len(request_bytes),
        "hybridserve.step.plan_step_request_b64": base64.b64encode(request_bytes).decode("ascii"),
    }


def observer_from_args(args: argparse.Namespace) -> TelemetryObserver | None:
    """The observer for this process (after start_service_telemetry), or None when tracing,
    metrics and recording are all off, so the engine keeps its no-op observer."""
    registry = process_registry()
    recorder = StepRecorder(args.record_steps, args.record_sample_rate) if args.record_steps else None
    observer = TelemetryObserver(metrics=WorkerMetrics(registry) if registry else None, recorder=recorder)
    return observer if observer.is_active else None
