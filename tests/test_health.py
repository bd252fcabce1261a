"""grpc.health.v1 on every server: `liveness`, `readiness` (and "" = readiness), over a real channel."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridserve import grpc_server
from scheduler_svc.server import create_server

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
NAMES = ("", "liveness", "readiness", "hybridserve.v1.Scheduler")


@pytest.fixture
def served():
    server, port, health = create_server("127.0.0.1", 0, max_workers=2)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)

    def status(name: str) -> int:
        return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status

    yield health, status
    channel.close()
    server.stop(None)


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "health did not change in time"
        time.sleep(0.02)


def test_both_names_serve_from_the_start(served):
    _, status = served
    assert [status(n) for n in NAMES] == [SERVING] * len(NAMES)


def test_draining_ends_readiness_and_keeps_liveness(served):
    health, status = served
    health.enter_graceful_shutdown()
    assert [status(n) for n in NAMES] == [NOT_SERVING, SERVING, NOT_SERVING, NOT_SERVING]
    health.set_ready(True)  # ignored while draining
    assert status("readiness") == NOT_SERVING


def test_probes_drive_liveness_and_readiness(served):
    health, status = served
    alive, ready = threading.Event(), threading.Event()
    alive.set()
    stop = grpc_server.watch_health(health, alive.is_set, ready.is_set, interval_s=0.02)
    try:
        wait_for(lambda: status("readiness") == NOT_SERVING)
        assert (status("liveness"), status("")) == (SERVING, NOT_SERVING)
        ready.set()
        wait_for(lambda: status("") == SERVING)
        alive.clear()  # a dead process is not ready either
        wait_for(lambda: status("liveness") == NOT_SERVING)
        wait_for(lambda: status("readiness") == NOT_SERVING)
    finally:
        stop.set()
