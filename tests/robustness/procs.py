"""Real processes for the robustness tests: a scheduler and workers (`hybridserve` children on
port 0 or a fixed port), their gRPC stubs and health probes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridserve.children import free_port
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from tests.gateway.conftest import start_worker as start_worker_process
from tests.procs import ServerProcess

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class WorkerClient:
    process: ServerProcess
    channel: grpc.Channel
    stub: pb_grpc.GenerationStub
    health: health_pb2_grpc.HealthStub

    def status(self, service: str = "readiness", timeout_s: float = 5.0) -> int:
        return int(self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status)

    def info(self) -> pb.GetInfoResponse:
        return self.stub.GetInfo(pb.GetInfoRequest(), timeout=5)

    def close(self) -> None:
        self.channel.close()
        self.process.stop()


def worker(model_dir, scheduler_address: str, *extra: str) -> WorkerClient:
    process = start_worker_process(model_dir, scheduler_address, 0, *extra)
    channel = grpc.insecure_channel(process.address)
    return WorkerClient(process, channel, pb_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel))


def scheduler(port: int = 0) -> ServerProcess:
    return ServerProcess(["scheduler", "--port", str(port or free_port())])


def text_request(prompt: str, max_tokens: int = 4, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    )


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def pools_free(info: pb.GetInfoResponse) -> bool:
    return (info.num_kv_pages_free, info.num_state_slots_free, info.num_running, info.num_waiting) == (
        info.num_kv_pages_total, info.num_state_slots_total, 0, 0,
    )  # fmt: skip
