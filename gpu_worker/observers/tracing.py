"""Tracing as an observer (docs/design.md, Observability).

Spans:
- `hybridserve.request`, one per request: opened when it is queued (a child of the Generate server
  span, so of the client's trace), one `first_token` event, attributes for the finish reason and
  token counts, ours (`hybridserve.*`) beside the OpenTelemetry GenAI names (`gen_ai.*`).
- `hybridserve.step`, one per engine step, the root of its own trace: the step record as
  attributes and a **link** to the span of each request the step served. The PlanStep call made
  inside the step (the plan of the next step, with async scheduling) is its child, and the
  scheduler's server span a child of that. When the step was recorded, its scheduler input rides
  along as an event (if small).

Cost: the engine thread only starts and stops spans and looks up the linked contexts; a step
span's attributes (computed once, from the record, and set in one call), links and end happen on
a background thread, off the step's critical path. The request span gets no per-token events.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from gpu_worker.engine.observer import EngineObserver
from gpu_worker.engine.records import CacheLookup, FirstToken, RequestFinished, RequestQueued, StepRecord
from gpu_worker.observers.recording import RecordingObserver
from hybridserve import telemetry

MAX_EVENT_INPUT_BYTES = 4096  # a recorded step input larger than this stays in the file only
PREFIX = "hybridserve.step."
Attributes = dict[str, AttributeValue]
Link = tuple[trace.SpanContext, int]  # a request span, and its tokens computed in the step


class TracingObserver(EngineObserver):
    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        model_name: str = "",
        recording: RecordingObserver | None = None,
    ) -> None:
        self._tracer = telemetry.get_tracer(tracer_provider)
        self._model_name = model_name
        self._recording = recording  # attach the step input it recorded to the step span
        self._request_spans: dict[str, trace.Span] = {}
        self._step_span: trace.Span | None = None
        self._step_details: tuple[StepRecord, list[Link], bytes | None] | None = None  # of the open step
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="trace-steps")  # completes step spans

    # ---- requests ---------------------------------------------------------------------------------
    def request_queued(self, event: RequestQueued) -> object | None:
        span = self._request_spans[event.request_id] = self._tracer.start_span(
            "hybridserve.request", kind=SpanKind.INTERNAL, attributes=request_attributes(event, self._model_name)
        )
        return trace.set_span_in_context(span)  # parents the request's cache calls

    def cache_lookup(self, event: CacheLookup) -> None:
        """The request's span says what the prefix cache gave it, why it stopped short, and
        whether the shared tier's blocks were fetched or recomputed."""
        span = self._request_spans.get(event.request_id)
        if span is None:
            return
        if event.decision:
            span.set_attribute("hybridserve.cache.shared.decision", event.decision)
        if event.tier == "worker":
            span.set_attributes({
                "hybridserve.cache.query_tokens": event.num_query_tokens,
                "hybridserve.cache.hit_tokens": event.num_hit_tokens,
                "hybridserve.cache.miss_reason": event.miss_reason or "none",
            })  # fmt: skip

    def request_first_token(self, event: FirstToken) -> None:
        span = self._request_spans.get(event.request_id)
        if span is not None:
            span.add_event("first_token")

    def request_finished(self, event: RequestFinished) -> None:
        span = self._request_spans.pop(event.request_id, None)
        if span is None:
            return
        span.set_attributes(
            {
                "hybridserve.finish_reason": event.reason.value,
                "hybridserve.completion_tokens": event.num_output_tokens,
                "hybridserve.cached_tokens": event.num_cached_tokens,
                "gen_ai.response.finish_reasons": [event.reason.value],
                "gen_ai.usage.input_tokens": event.num_prompt_tokens,
                "gen_ai.usage.output_tokens": event.num_output_tokens,
            }
        )
        if event.num_draft_tokens:  # speculative decoding
            span.set_attributes({
                "hybridserve.spec_decode.num_draft_tokens": event.num_draft_tokens,
                "hybridserve.spec_decode.num_accepted_tokens": event.num_accepted_tokens,
                "hybridserve.spec_decode.acceptance_rate": event.num_accepted_tokens / event.num_draft_tokens,
            })  # fmt: skip
        if event.error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{type(event.error).__name__}: {event.error}"))
        span.end()

    # ---- steps ------------------------------------------------------------------------------------
    def step(self, step_index: int) -> AbstractContextManager[Any]:
        return self._traced_step(step_index)

    @contextmanager
    def _traced_step(self, step_index: int) -> Iterator[trace.Span]:
        root = otel_context.Context()  # each step is the root of its own trace
        span = self._tracer.start_span("hybridserve.step", context=root, attributes={PREFIX + "index": step_index})
        self._step_span, self._step_details = span, None
        try:
            with trace.use_span(span, end_on_exit=False):
                yield span
        finally:
            end_ns = time.time_ns()
            details, self._step_span, self._step_details = self._step_details, None, None
            if details is None:  # no step ran (planning failed)
                span.end(end_ns)
            else:
                self._finisher.submit(_complete_step, span, *details, end_ns)

    def step_finished(self, record: StepRecord) -> None:
        span = self._step_span
        if span is None or not span.is_recording():
            return
        links: list[Link] = []
        for s in record.served:
            request_span = self._request_spans.get(s.request_id)
            if request_span is not None:
                links.append((request_span.get_span_context(), s.num_tokens))
        sent = self._recording.recorded_input(record.step_index) if self._recording is not None else None
        self._step_details = (record, links, sent)

    def close(self) -> None:
        """Completes the step spans still queued."""
        self._finisher.shutdown(wait=True)


def _complete_step(span: trace.Span, record: StepRecord, links: list[Link], sent: bytes | None, end_ns: int) -> None:
    """Sets a step span's attributes, links and input event, and ends it (on the finisher thread)."""
    span.set_attributes(step_attributes(record))
    for context, num_tokens in links:  # the linked span names the request
        span.add_link(context, {"hybridserve.num_tokens": num_tokens})
    if sent is not None:
        span.add_event("hybridserve.step.input", _input_event(sent), timestamp=end_ns)
    span.end(end_ns)


def request_attributes(event: RequestQueued, model_name: str) -> Attributes:
    attrs: Attributes = {
        "hybridserve.request_id": event.request_id,
        "hybridserve.prompt_tokens": event.num_prompt_tokens,
        "hybridserve.max_tokens": event.max_tokens,
        "hybridserve.priority": event.priority,
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.max_tokens": event.max_tokens,
        "gen_ai.request.temperature": event.temperature,
        "gen_ai.request.top_p": event.top_p,
        "gen_ai.response.id": event.request_id,
    }
    if model_name:
        attrs["gen_ai.request.model"] = attrs["gen_ai.response.model"] = model_name
    if event.top_k:
        attrs["gen_ai.request.top_k"] = event.top_k
    if event.seed is not None:
        attrs["gen_ai.request.seed"] = event.seed
    if event.stop:
        attrs["gen_ai.request.stop_sequences"] = list(event.stop)
    return attrs


def step_attributes(record: StepRecord) -> Attributes:
    """What the step executed (over the slices that ran), the plan as the scheduler returned it,
    and what the scheduler saw. Every attribute is encoded for export each step, holding the GIL the
    engine thread needs, so constants (the config) and what the span itself, other attributes or
    the links give (the step's duration, which slices were prefills) are left out."""
    served = record.served
    prefill = [s for s in served if s.is_prefill]
    num_prefill_tokens = sum(s.num_tokens for s in prefill)
    num_decode_tokens = sum(s.num_tokens for s in served) - num_prefill_tokens
    plan, stats = record.plan, record.plan.stats
    attrs: Attributes = {
        PREFIX + "num_slices": len(served),
        PREFIX + "num_prefill_slices": len(prefill),
        PREFIX + "num_prefill_tokens": num_prefill_tokens,
        PREFIX + "num_decode_tokens": num_decode_tokens,
        PREFIX + "budget_used_tokens": num_prefill_tokens + num_decode_tokens,
        PREFIX + "num_skipped_slices": record.num_skipped_slices,
        PREFIX + "num_checkpoint_slices": sum(1 for s in served if s.ends_on_checkpoint),
        PREFIX + "quantum": plan.quantum,
        PREFIX + "planned_prefill_tokens": stats.num_prefill_tokens,
        PREFIX + "planned_decode_tokens": stats.num_decode_tokens,
        PREFIX + "prefill_budget_tokens": stats.prefill_budget_tokens,
        PREFIX + "num_pending_prefills": stats.num_pending_prefills,
        PREFIX + "stalled": stats.stalled,
        PREFIX + "micro_sliced": stats.micro_sliced,
        PREFIX + "num_kv_pages_allocated": stats.num_kv_pages_allocated,
        PREFIX + "num_preemptions": len(plan.preempted_request_ids),
        PREFIX + "plan_latency_s": record.plan_latency_s,
        PREFIX + "plan_wait_s": record.plan_wait_s,
    }
    if plan.preempted_request_ids:
        attrs[PREFIX + "preempted_request_ids"] = list(plan.preempted_request_ids)
    if record.drafts:  # speculative decoding: drafted, accepted and rejected tokens, and of which requests
        drafted, accepted = record.num_draft_tokens, record.num_accepted_tokens
        attrs[PREFIX + "num_draft_tokens"] = drafted
        attrs[PREFIX + "num_accepted_tokens"] = accepted
        attrs[PREFIX + "num_rejected_tokens"] = drafted - accepted
        attrs[PREFIX + "drafted_request_ids"] = [rid for rid, _, _ in record.drafts]
        attrs[PREFIX + "drafts_accepted"] = [a for _, _, a in record.drafts]
    step_input = record.step_input
    if step_input is not None:
        attrs[PREFIX + "num_running"] = len(step_input.running)
        attrs[PREFIX + "num_waiting"] = len(step_input.waiting)
        attrs[PREFIX + "num_free_kv_pages"] = step_input.num_free_kv_pages
        if step_input.share is not None:  # the prefill compute share this step was planned with
            attrs[PREFIX + "prefill_share"] = step_input.share.share
            attrs[PREFIX + "prefill_share_target"] = step_input.share.target
    return attrs


def _input_event(request_bytes: bytes) -> Attributes:
    if len(request_bytes) > MAX_EVENT_INPUT_BYTES:
        return {"hybridserve.step.input_bytes": len(request_bytes)}
    return {
        "hybridserve.step.input_bytes": len(request_bytes),
        "hybridserve.step.plan_step_request_b64": base64.b64encode(request_bytes).decode("ascii"),
    }
