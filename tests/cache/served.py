"""A worker for any checkpoint and scheduler config: runner + engine + Generation service on port 0,
talking to a real Scheduler over gRPC; optionally with the shared tier at `cache_address`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest

from gpu_worker.api.server import build_prefix_cache
from gpu_worker.api.service import GenerationServicer, add_to_server
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.observer import EngineObserver, FanOut
from gpu_worker.engine.records import StepRecord
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from hybridserve import grpc_server
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.client import SchedulerClient
from scheduler_svc.core import SchedulerConfig
from tests.worker.conftest import SHARED_ACCESS, collect, greedy_request


class ChunkLog(EngineObserver):
    """Prefill chunk lengths per step, in order."""

    def __init__(self) -> None:
        self.prefill_chunks: list[int] = []

    def step_finished(self, record: StepRecord) -> None:
        self.prefill_chunks += [s.num_tokens for s in record.served if s.is_prefill]


@dataclass
class Served:
    engine: Engine
    stub: pb_grpc.GenerationStub
    chunks: ChunkLog

    def run(self, prompt: list[int], max_tokens: int = 8) -> tuple[list[int], list[float], int]:
        """Greedy tokens, the chosen and top-5 logprobs of each, and the prompt tokens served from
        the prefix cache."""
        request = greedy_request(prompt, max_tokens, logprobs=5)
        tokens, messages = collect(self.stub.Generate(request, timeout=120))
        logprobs = [lp for m in messages for lp in m.logprobs]
        top = [lp for m in messages for t in m.top_logprobs for lp in t.logprobs]
        assert len(top) == 5 * len(tokens)
        return tokens, logprobs + top, messages[-1].usage.cached_tokens

    def info(self) -> pb.GetInfoResponse:
        return self.stub.GetInfo(pb.GetInfoRequest(), timeout=5)


def assert_same(got: tuple[list[int], list[float], int], want: tuple[list[int], list[float], int]) -> None:
    """Greedy tokens identical, every logprob (chosen and top 5) within 1e-4."""
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-4


@pytest.fixture
def serve(scheduler_address) -> Iterator[Callable[..., Served]]:
    """serve(path, config, prefix_caching, cache_address=None, num_checkpoint_slots=32, observer=None,
    **engine settings)."""
    started: list[tuple[grpc.Server, Engine, grpc.Channel, SchedulerClient]] = []

    def start(
        path: Path,
        config: SchedulerConfig,
        prefix_caching: bool,
        cache_address: str | None = None,
        num_checkpoint_slots: int = 32,
        observer: EngineObserver | None = None,
        **overrides: object,
    ) -> Served:
        runner_config = RunnerConfig(
            memory_budget_bytes=16 << 20, kv_page_size_tokens=config.kv_page_size, max_num_seqs=config.max_num_seqs,
            num_checkpoint_slots=num_checkpoint_slots, device="cpu", dtype="float32",
        )  # fmt: skip
        settings = EngineSettings(
            scheduler=config, runner=runner_config, scheduler_addresses=(scheduler_address,),
            cache_address=cache_address,
        )  # fmt: skip
        settings = replace(settings, **overrides)
        client = SchedulerClient((scheduler_address,), deadline_s=settings.scheduler_deadline_s,
                                 give_up_after_s=settings.scheduler_give_up_s)  # fmt: skip
        runner = ModelRunner.from_model_dir(path, runner_config)
        chunks = ChunkLog()
        observers = FanOut([chunks, observer]) if observer is not None else chunks
        engine = Engine(runner, client.plan, settings, observer=observers, prefix=build_prefix_cache(
            runner, settings, prefix_caching, SHARED_ACCESS))  # fmt: skip
        engine.start()
        server, port, _ = grpc_server.create_server([add_to_server(GenerationServicer(engine, path.name))])
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        started.append((server, engine, channel, client))
        return Served(engine, pb_grpc.GenerationStub(channel), chunks)

    yield start
    for server, engine, channel, client in started:
        channel.close()
        server.stop(None)
        engine.stop()
        client.close()
