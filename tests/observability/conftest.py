"""In-process stacks for observability tests: a traced Scheduler and a worker whose engine has a
fan-out of observers (tracing, metrics, recording), both on port 0, with an explicit tracer
provider (an in-memory exporter) and a fresh metrics registry, so nothing depends on the
process-global OpenTelemetry state."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from gpu_worker.api.service import GenerationServicer, add_to_server
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.observer import FanOut
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.observers import build_observers
from gpu_worker.observers.recording import StepRecorder
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from hybridserve import grpc_server
from hybridserve.metrics import WorkerMetrics
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint
from scheduler_svc import service
from scheduler_svc.client import SchedulerClient
from scheduler_svc.core import SchedulerConfig
from tests.worker.conftest import SCHEDULER

TINY = ModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=(1, 3))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny-default"), TINY, seed=3)


@dataclass
class Stack:
    stub: pb_grpc.GenerationStub
    engine: Engine
    observer: FanOut
    exporter: InMemorySpanExporter
    provider: TracerProvider
    registry: CollectorRegistry
    stoppers: list[Callable[[], None]] = field(default_factory=list)

    def stop(self) -> None:
        while self.stoppers:
            self.stoppers.pop()()


@pytest.fixture
def start_stack(model_dir, monkeypatch) -> Iterator[Callable[..., Stack]]:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")  # tests/conftest.py turns the SDK off by default
    stacks: list[Stack] = []

    def start(
        record: Path | None = None, traced: bool = True, scheduler: SchedulerConfig = SCHEDULER,
        speculative_tokens: int = 0,
    ) -> Stack:  # fmt: skip
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        use = provider if traced else None
        registry = CollectorRegistry()
        sched, sched_port, _ = grpc_server.create_server([service.add_to_server], tracer_provider=use)
        sched.start()
        runner_config = RunnerConfig(
            memory_budget_bytes=16 << 20, kv_page_size_tokens=scheduler.kv_page_size,
            max_num_seqs=scheduler.max_num_seqs, num_checkpoint_slots=4, device="cpu", dtype="float32",
            num_draft_rows=4 * speculative_tokens,
        )  # fmt: skip
        address = f"127.0.0.1:{sched_port}"
        settings = EngineSettings(
            scheduler=scheduler, runner=runner_config, scheduler_addresses=(address,),
            num_speculative_tokens=speculative_tokens,
        )  # fmt: skip
        client = SchedulerClient([address], tracer_provider=use)
        observer = build_observers(
            tracer_provider=use,
            metrics=WorkerMetrics(registry),
            recorder=StepRecorder(record) if record is not None else None,
            model_name="tiny",
        )
        engine = Engine(ModelRunner.from_model_dir(model_dir, runner_config), client.plan, settings, observer)
        engine.start()
        server, port, _ = grpc_server.create_server(
            [add_to_server(GenerationServicer(engine, "tiny"))], tracer_provider=use
        )
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stack = Stack(pb_grpc.GenerationStub(channel), engine, observer, exporter, provider, registry)
        stack.stoppers += [lambda: sched.stop(None), client.close, observer.close, engine.stop]
        stack.stoppers += [lambda: server.stop(None), channel.close]
        stacks.append(stack)
        return stack

    yield start
    for stack in stacks:
        stack.stop()


def greedy(prompt_ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt_ids),
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def prompt_of(length: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]
