"""The dispatcher against a stand-in worker on a real gRPC server (port 0, a real channel): a stream
ends at the worker's last message without waiting for the worker's status, and the worker's call is
still left to end by itself (OK), not cancelled (which would abort the request on the worker)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from gateway.affinity import PrefixTable
from gateway.dispatch import Dispatcher, RoutingSettings
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc


class HeldStatusWorker(pb_grpc.GenerationServicer):
    """Streams two messages, the second with a finish reason, then holds its status until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.outcome = ""  # "returned" or "cancelled", once the call ended on this side

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[5])
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[6], finish_reason=pb.FINISH_REASON_LENGTH)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.outcome = "cancelled"
            raise
        self.outcome = "returned"

    async def GetInfo(self, request: pb.GetInfoRequest, context: Any) -> pb.GetInfoResponse:
        return pb.GetInfoResponse(model="stand-in", block_size=4)


async def _until(condition: Any, timeout_s: float) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


def test_a_stream_ends_at_the_last_message_and_the_worker_call_is_not_cancelled() -> None:
    async def scenario() -> dict[str, Any]:
        worker = HeldStatusWorker()
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(worker, server)  # type: ignore[no-untyped-call]
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = WorkerPool([f"127.0.0.1:{port}"])
        try:
            await pool.start()
            dispatcher = Dispatcher(pool, PrefixTable(), RoutingSettings(), GatewayMetrics())
            request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2, 3, 4]))

            async def relay() -> list[pb.GenerateResponse]:
                return [m async for m in dispatcher.generate(request, (), 4)]

            messages = await asyncio.wait_for(relay(), 30)  # hangs (fails) if the stream waits for the status
            seen = {
                "tokens": [list(m.token_ids) for m in messages],
                "outcome_at_end": worker.outcome,
                "in_flight_at_end": pool.workers[f"127.0.0.1:{port}"].num_in_flight,
                "live_at_end": dict(dispatcher.live),
            }
            worker.release.set()
            await _until(lambda: worker.outcome != "", 30)
            seen["outcome"] = worker.outcome
            return seen
        finally:
            await pool.close()
            await server.stop(None)

    seen = asyncio.run(scenario())
    assert seen["tokens"] == [[5], [6]]
    assert seen["outcome_at_end"] == ""  # the worker had not sent its status when the stream ended
    assert seen["in_flight_at_end"] == 0 and seen["live_at_end"] == {}
    assert seen["outcome"] == "returned"  # the finished call was left to end, not cancelled
