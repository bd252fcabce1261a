"""`hybridserve scheduler` as a real process: port 0, health, reflection, logging of rejections,
graceful SIGTERM, and determinism across restarts."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from hybridserve.v1 import scheduler_pb2_grpc
from scheduler_svc import convert
from tests.procs import ServerProcess
from tests.scheduler.helpers import config, seed_step, step


def plan_bytes(address: str, payload: bytes) -> bytes:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/hybridserve.v1.Scheduler/PlanStep")
        return call(payload, timeout=10)


def test_serves_health_reflection_logs_rejections_and_stops_on_sigterm():
    server = ServerProcess(["scheduler", "--port", "0"])
    try:
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "hybridserve.v1.Scheduler"):
                status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
            assert {"hybridserve.v1.Scheduler", "grpc.health.v1.Health"} <= services
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            bad = convert.step_to_pb(step(config(max_num_prefill_tokens_per_step=2304), seed_step().running))
            with pytest.raises(grpc.RpcError) as err:
                stub.PlanStep(bad, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert stub.PlanStep(convert.step_to_pb(seed_step()), timeout=5).stats.num_prefill_tokens == 4096
    finally:
        code = server.stop()
    assert code == 0, server.output
    assert "rejected /hybridserve.v1.Scheduler/PlanStep: INVALID_ARGUMENT" in server.output
    assert "2304" in server.output
    assert "received SIGTERM" in server.output and "stopped" in server.output


def test_same_request_bytes_give_same_response_bytes_across_restarts():
    payloads = [convert.step_to_pb(seed_step(i)).SerializeToString(deterministic=True) for i in range(4)]
    answers = []
    for _ in range(2):
        with ServerProcess(["scheduler", "--port", "0"]) as server:
            answers.append([plan_bytes(server.address, p) for p in payloads])
    assert answers[0] == answers[1]
    assert len(set(answers[0])) > 1, "different steps plan differently (rotation)"
