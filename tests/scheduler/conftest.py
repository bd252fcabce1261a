"""A real Scheduler server on port 0 and a stub over a real channel."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from hybridserve.v1 import scheduler_pb2_grpc
from scheduler_svc.server import create_server


@pytest.fixture(scope="module")
def scheduler_address() -> Iterator[str]:
    server, port, _ = create_server("127.0.0.1", 0, max_message_bytes=4 * 1024 * 1024)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def channel(scheduler_address: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(scheduler_address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> scheduler_pb2_grpc.SchedulerStub:
    return scheduler_pb2_grpc.SchedulerStub(channel)
