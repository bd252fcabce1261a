"""The gateway's span roots each request's trace (or joins the client's W3C traceparent), and the
worker's spans join it: real gateway and worker processes exporting over OTLP to a test receiver."""

from __future__ import annotations

import json
import urllib.request

import pytest

from hybridserve.children import free_port
from tests.gateway.conftest import MODEL_NAME, start_gateway, start_worker, wait_ready
from tests.observability.otlp_receiver import Receiver

pytestmark = pytest.mark.slow

SERVER = 2  # opentelemetry.proto Span.SpanKind
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


def post_completion(address: str, headers: dict[str, str]) -> dict:
    fields = {"model": MODEL_NAME, "prompt": "Trace me", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    body = json.dumps(fields).encode()
    request = urllib.request.Request(f"http://{address}/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_gateway_span_roots_the_trace_and_the_worker_joins_it(model_dir, scheduler, monkeypatch):
    receiver = Receiver()
    for name, value in {"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp",
                        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_INSECURE": "true",
                        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
                        "OTEL_BSP_SCHEDULE_DELAY": "100"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)  # inherited by the children started below
    worker = start_worker(model_dir, scheduler.address, free_port())
    gateway = start_gateway([worker.address], model_dir)
    try:
        wait_ready(gateway, 1)
        post_completion(gateway.address, {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"})
        post_completion(gateway.address, {})

        def complete(spans) -> bool:  # the worker's server span ends after its request span: wait for both
            names = [(s.service, s.name) for s in spans]
            wanted = (("hybridserve-gateway", "POST /v1/completions"), ("hybridserve-worker", "hybridserve.request"),
                      ("hybridserve-worker", "hybridserve.v1.Generation/Generate"))  # fmt: skip
            return all(names.count(name) == 2 for name in wanted)

        spans = receiver.wait_for(complete, timeout_s=30)
    finally:
        gateway.stop()
        worker.stop()
        receiver.stop()
    roots = [s for s in spans if s.service == "hybridserve-gateway" and s.name == "POST /v1/completions"]
    assert len(roots) == 2, sorted({(s.service, s.name) for s in spans})
    joined, own = sorted(roots, key=lambda s: s.trace_id != CLIENT_TRACE_ID)
    assert joined.trace_id == CLIENT_TRACE_ID and joined.parent_span_id == CLIENT_SPAN_ID
    assert own.trace_id != CLIENT_TRACE_ID and own.parent_span_id == ""  # no traceparent: the gateway is the root
    for root in (joined, own):
        assert root.kind == SERVER and root.attributes["gen_ai.request.model"] == MODEL_NAME
        assert root.attributes["gen_ai.usage.output_tokens"] == 3  # ignore_eos: a sampled EOS would end it early
        (generate,) = [s for s in spans if s.service == "hybridserve-worker" and s.trace_id == root.trace_id
                       and s.name == "hybridserve.v1.Generation/Generate"]  # fmt: skip
        assert generate.parent_span_id == root.span_id
