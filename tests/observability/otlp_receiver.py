"""A test OTLP/gRPC trace receiver built from the opentelemetry-proto messages: collects every span
exported to it, with the exporting service's name."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict
    links: tuple[tuple[str, str], ...]  # (trace_id, span_id)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            service=attrs.get("service.name", ""),
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                        )
                    )
        with self._lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout_s: float = 10.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            time.sleep(0.05)
        return list(self.spans)

    def stop(self) -> None:
        self.server.stop(None)
