"""`hybridserve health`, the probe the image and the compose files use, against real gRPC servers."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from grpc_health.v1 import health, health_pb2

from hybridserve import grpc_server
from hybridserve.children import free_port
from hybridserve_cli.health import check

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def server() -> Iterator[tuple[str, health.HealthServicer]]:
    srv, port, servicer = grpc_server.create_server([], host="127.0.0.1", port=0)
    srv.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        srv.stop(0).wait()


def test_named_checks_answer_for_themselves(server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = server
    servicer.set("readiness", NOT_SERVING)
    servicer.set("liveness", SERVING)
    assert check(address, "liveness", 3.0) == (True, f"{address} liveness: SERVING")
    serving, seen = check(address, "readiness", 3.0)
    assert not serving and "NOT_SERVING" in seen


def test_a_server_without_named_checks_answers_with_its_overall_status(
    server: tuple[str, health.HealthServicer],
) -> None:
    address, servicer = server
    assert check(address, "readiness", 3.0)[0]
    servicer.enter_graceful_shutdown()
    serving, seen = check(address, "readiness", 3.0)
    assert not serving and "NOT_SERVING" in seen


def test_nothing_listening_is_unhealthy() -> None:
    serving, seen = check(f"127.0.0.1:{free_port()}", "liveness", 1.0)
    assert not serving and ("UNAVAILABLE" in seen or "DEADLINE_EXCEEDED" in seen), seen


def test_command_exit_codes(server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = server
    probe = [sys.executable, "-m", "hybridserve_cli", "health", address, "--timeout", "5"]
    ok = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    servicer.set("readiness", NOT_SERVING)
    bad = subprocess.run([*probe, "--service", "readiness"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "NOT_SERVING" in bad.stderr
