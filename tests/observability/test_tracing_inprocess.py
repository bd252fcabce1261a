"""Tracing in one process with the SDK's in-memory exporter: the span tree of a generation, the
links from step spans to the request span, and step attributes equal to the executed plan."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from hybridserve.telemetry import TracingConfig, setup_tracing, tracing_enabled
from hybridserve.v1 import scheduler_pb2
from scheduler_svc.step_records import read_records
from tests.observability.conftest import greedy, prompt_of

PLAN_STEP = "hybridserve.v1.Scheduler/PlanStep"


def by_name(spans, name):
    return [s for s in spans if s.name == name]


def test_generation_span_tree_links_and_step_attributes(start_stack, tmp_path):
    record = tmp_path / "steps.jsonl"
    stack = start_stack(record=record)
    tracer = stack.provider.get_tracer("test")
    prompt, max_tokens = prompt_of(40, 1), 6
    with tracer.start_as_current_span("client call") as root:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        messages = list(stack.stub.Generate(greedy(prompt, max_tokens), metadata=list(carrier.items()), timeout=60))
    assert sum(len(m.token_ids) for m in messages) == max_tokens
    stack.stop()
    spans = stack.exporter.get_finished_spans()
    ids = {s.context.span_id: s for s in spans}

    # client -> Generate server span -> request span, one trace
    (generate,) = by_name(spans, "hybridserve.v1.Generation/Generate")
    assert generate.kind == SpanKind.SERVER and generate.parent.span_id == root.get_span_context().span_id
    (request,) = by_name(spans, "hybridserve.request")
    assert request.parent.span_id == generate.context.span_id
    assert request.context.trace_id == root.get_span_context().trace_id
    assert request.attributes["hybridserve.finish_reason"] == "length"
    assert request.attributes["hybridserve.completion_tokens"] == max_tokens
    assert request.attributes["hybridserve.prompt_tokens"] == len(prompt)
    assert [e.name for e in request.events] == ["first_token"]

    # each step is its own trace root, linked to the request it served
    steps = by_name(spans, "hybridserve.step")
    assert steps and all(s.parent is None for s in steps)
    linked = [s for s in steps if any(link.context.span_id == request.context.span_id for link in s.links)]
    assert linked == [s for s in steps if s.attributes.get("hybridserve.step.num_slices")]
    assert sum(s.attributes["hybridserve.step.num_prefill_tokens"] for s in linked) == len(prompt)
    assert sum(s.attributes["hybridserve.step.num_decode_tokens"] for s in linked) == max_tokens - 1
    for s in linked:
        (link,) = s.links
        assert link.attributes["hybridserve.num_tokens"] == s.attributes["hybridserve.step.budget_used_tokens"]

    # PlanStep: worker CLIENT span under a step span, scheduler SERVER span under it, same trace
    clients = [s for s in by_name(spans, PLAN_STEP) if s.kind == SpanKind.CLIENT]
    servers = [s for s in by_name(spans, PLAN_STEP) if s.kind == SpanKind.SERVER]
    assert clients and len(clients) == len(servers)
    for client in clients:
        assert ids[client.parent.span_id].name == "hybridserve.step"
        assert client.context.trace_id == ids[client.parent.span_id].context.trace_id
    for server in servers:
        parent = ids[server.parent.span_id]
        assert parent.kind == SpanKind.CLIENT and parent.context.trace_id == server.context.trace_id
        assert server.attributes["rpc.grpc.status_code"] == 0

    # step attributes equal the plan that executed (recorded, every step) and carry the input
    records = {index: (req, plan) for index, req, plan in read_records(record)}
    assert len(records) == len(steps)
    for s in steps:
        request_pb, plan = records[s.attributes["hybridserve.step.index"]]
        a = s.attributes
        assert a["hybridserve.step.quantum"] == plan.quantum
        assert a["hybridserve.step.planned_prefill_tokens"] == plan.stats.num_prefill_tokens
        assert a["hybridserve.step.planned_decode_tokens"] == plan.stats.num_decode_tokens
        assert a["hybridserve.step.stalled"] == plan.stats.stalled
        assert a["hybridserve.step.num_preemptions"] == len(plan.preempted_request_ids)
        executed = sum(x.num_tokens for x in plan.slices) if a["hybridserve.step.num_skipped_slices"] == 0 else None
        if executed is not None:
            assert a["hybridserve.step.budget_used_tokens"] == executed
        (event,) = [e for e in s.events if e.name == "hybridserve.step.input"]
        sent = base64.b64decode(event.attributes["hybridserve.step.plan_step_request_b64"])
        assert scheduler_pb2.PlanStepRequest.FromString(sent) == request_pb


def test_concurrent_requests_each_get_their_links(start_stack):
    stack = start_stack()
    prompts = [prompt_of(20 + 7 * i, i) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: list(stack.stub.Generate(greedy(p, 5), timeout=60)), prompts))
    assert all(sum(len(m.token_ids) for m in out) == 5 for out in outs)
    stack.stop()
    spans = stack.exporter.get_finished_spans()
    requests = {s.context.span_id: s for s in spans if s.name == "hybridserve.request"}
    assert len(requests) == 3
    tokens = dict.fromkeys(requests, 0)
    for step in (s for s in spans if s.name == "hybridserve.step"):
        for link in step.links:
            tokens[link.context.span_id] += link.attributes["hybridserve.num_tokens"]
    for span_id, span in requests.items():  # every computed token of every request is linked
        assert tokens[span_id] == span.attributes["hybridserve.prompt_tokens"] + 5 - 1


def test_tracing_off_installs_nothing(start_stack):
    assert TracingConfig.from_env({"OTEL_SDK_DISABLED": "true"}).enabled is False
    assert TracingConfig.from_env({"OTEL_TRACES_EXPORTER": "none"}).enabled is False
    on = TracingConfig.from_env(
        {"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    )
    assert on.exporters == ("otlp", "console") and on.otlp_protocol == "http/protobuf"
    setup_tracing("test", TracingConfig())()  # no-op; the global provider stays the API's
    assert not tracing_enabled()
    stack = start_stack(traced=False)
    list(stack.stub.Generate(greedy(prompt_of(10, 0), 2), timeout=60))
    stack.stop()
    assert stack.exporter.get_finished_spans() == ()
    assert json.dumps(stack.observer.is_active)  # metrics still on
