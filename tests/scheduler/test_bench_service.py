"""The benchmark-only SchedulerBench service: off unless asked for, an echo when on."""

from __future__ import annotations

import grpc
import pytest

from hybridserve.v1 import scheduler_bench_pb2 as bench_pb
from hybridserve.v1 import scheduler_bench_pb2_grpc as bench_pb_grpc
from scheduler_svc.server import create_server


@pytest.mark.parametrize("enabled", [False, True], ids=["default", "bench-service"])
def test_echo_is_served_only_when_enabled(enabled):
    server, port, _ = create_server("127.0.0.1", 0, max_workers=2, bench_service=enabled)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = bench_pb_grpc.SchedulerBenchStub(channel)
            request = bench_pb.EchoRequest(payload=b"\x00\x01plan-sized")
            if enabled:
                assert stub.Echo(request, timeout=5).payload == request.payload
            else:
                with pytest.raises(grpc.RpcError) as err:
                    stub.Echo(request, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(None)
