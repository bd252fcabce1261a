"""Real `hybridserve scheduler` and `hybridserve worker` processes exporting spans over OTLP/gRPC
to a test receiver: one request's spans join up across processes; /metrics of both move."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request

import grpc
import pytest
from opentelemetry import propagate
from opentelemetry.sdk.trace import TracerProvider

from hybridserve.children import Child
from hybridserve.v1 import generation_pb2_grpc
from hybridserve_cli.stack import Stack
from tests.observability.conftest import greedy, prompt_of
from tests.observability.otlp_receiver import Receiver

SERVER, CLIENT = 2, 3  # opentelemetry.proto Span.SpanKind
PLAN_STEP = "hybridserve.v1.Scheduler/PlanStep"
LOOKUP = "hybridserve.v1.BlockCache/Lookup"


def metrics_port(proc: Child) -> int:
    match = re.search(r"metrics on \S+:(\d+)", proc.output)
    assert match, proc.output
    return int(match.group(1))


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} missing"
    return float(match.group(1))


@pytest.mark.slow
def test_one_request_traced_across_worker_scheduler_and_cache(tmp_path, monkeypatch):
    model = tmp_path / "model"
    subprocess.run([sys.executable, "-m", "hybridserve_cli", "init-model", str(model)], check=True, timeout=120)
    receiver = Receiver()
    env = {
        "OTEL_SDK_DISABLED": "false",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "HYBRIDSERVE_CLUSTER_TOKEN": "observability-test-token",  # the cache service and the worker
        "HYBRIDSERVE_WORKER_CHECKPOINT_KEY": "observability-test-checkpoint-key",
    }
    stack = Stack(start_timeout_s=60, stop_timeout_s=30, die_with_parent=False, keep_lines=100_000)  # runs gRPC
    try:
        scheduler = stack.scheduler(flags=["--metrics-port", "0"], env=env)
        cache = stack.cache(stack.redis(), env=env)
        worker = stack.worker(model, [scheduler], cache, flags=[
            "--metrics-port", "0", "--device", "cpu", "--memory-budget-mb", "32", "--max-num-seqs", "4",
            "--num-checkpoint-slots", "8", "--block-size", "16", "--mamba-block-size", "8",
        ], env=env)  # fmt: skip
        monkeypatch.setenv("OTEL_SDK_DISABLED", "false")
        with TracerProvider().get_tracer("test").start_as_current_span("client") as root:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            with grpc.insecure_channel(worker.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                messages = list(stub.Generate(greedy(prompt_of(30, 2), 5), metadata=list(carrier.items()), timeout=60))
        assert sum(len(m.token_ids) for m in messages) == 5
        worker_metrics = scrape(metrics_port(stack["worker"].child))
        scheduler_metrics = scrape(metrics_port(stack["scheduler"].child))
    finally:
        codes = {s.name: stack.terminate(s.name) for s in reversed(stack.services) if s.name != "redis"}
        stack.stop()
        assert all(code == 0 for code in codes.values()), [(s.name, s.child.output) for s in stack.services]
    receiver.stop()

    assert sample(worker_metrics, 'hybridserve_generation_tokens_total{model_name="model"}') == 5
    assert sample(worker_metrics, 'hybridserve_request_success_total{finished_reason="length",model_name="model"}') == 1
    assert sample(worker_metrics, 'hybridserve_computed_tokens_total{kind="prefill"}') == 30
    num_steps = sample(worker_metrics, "hybridserve_steps_total")
    assert (
        sample(
            scheduler_metrics,
            'hybridserve_rpc_seconds_count{method="/hybridserve.v1.Scheduler/PlanStep",side="server"}',
        )
        >= num_steps - 1
    )

    spans = receiver.spans
    by_id = {s.span_id: s for s in spans}
    trace_id = format(root.get_span_context().trace_id, "032x")
    (generate,) = [s for s in spans if s.name == "hybridserve.v1.Generation/Generate"]
    (request,) = [s for s in spans if s.name == "hybridserve.request"]
    assert generate.service == request.service == "hybridserve-worker"
    assert generate.trace_id == request.trace_id == trace_id
    assert generate.parent_span_id == format(root.get_span_context().span_id, "016x")
    assert request.parent_span_id == generate.span_id

    # The request's prefix lookup in the shared tier: a worker client span under the request span,
    # and the cache service's server span under that, all in the client's trace.
    lookups = [s for s in spans if s.name == LOOKUP and s.kind == CLIENT]
    assert lookups and all(s.parent_span_id == request.span_id and s.trace_id == trace_id for s in lookups), sorted(
        {(s.service, s.name, s.kind) for s in spans}
    )
    for lookup in lookups:
        (served,) = [s for s in spans if s.parent_span_id == lookup.span_id]
        assert served.service == "hybridserve-cache" and served.kind == SERVER and served.trace_id == trace_id

    steps = [s for s in spans if s.name == "hybridserve.step" and (request.trace_id, request.span_id) in s.links]
    assert len(steps) == num_steps
    for step in steps:
        assert step.service == "hybridserve-worker" and step.parent_span_id == ""
    step_ids = {s.span_id for s in steps}
    clients = [s for s in spans if s.name == PLAN_STEP and s.kind == CLIENT and s.parent_span_id in step_ids]
    assert clients, "no PlanStep client span under a step span"
    for client in clients:
        assert client.service == "hybridserve-worker" and client.trace_id == by_id[client.parent_span_id].trace_id
        (server,) = [s for s in spans if s.parent_span_id == client.span_id]
        assert server.service == "hybridserve-scheduler" and server.kind == SERVER and server.name == PLAN_STEP
        assert server.trace_id == client.trace_id
