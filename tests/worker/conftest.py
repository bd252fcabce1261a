"""Real in-process servers for worker tests: a Scheduler on port 0 and a worker (model runner +
engine + Generation service) on port 0, talking over real gRPC channels."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest

from gpu_worker.api.server import build_prefix_cache
from gpu_worker.api.service import GenerationServicer, add_to_server
from gpu_worker.cache.remote import SharedTierAccess
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.observer import EngineObserver
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.runner.model_process import ProcessRunner, build_runner
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from hybridserve import grpc_server
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.client import SchedulerClient
from scheduler_svc.core import MambaCacheMode, SchedulerConfig
from scheduler_svc.server import create_server
from tests.model.model_helpers import TinySpec, make_hf_model, save_hf_model

SHARED_ACCESS = SharedTierAccess(b"test-checkpoint-key-0123456789", "test-cluster-token")  # every test worker's
SPEC = TinySpec(seed=5, vocab_size=120, hidden_size=64, num_hidden_layers=4, attn_layer_indices=(1, 3))

SCHEDULER = SchedulerConfig(
    max_num_batched_tokens=64,
    max_num_seqs=8,
    long_prefill_token_threshold=0,
    max_num_prefill_tokens_per_step=32,
    block_size=16,
    mamba_block_size=8,
    mamba_cache_mode=MambaCacheMode.ALIGN,
    kv_page_size=4,
)


@pytest.fixture(scope="session")
def hf_model():
    return make_hf_model(SPEC)


@pytest.fixture(scope="session")
def checkpoint(hf_model, tmp_path_factory) -> Path:
    return save_hf_model(hf_model, tmp_path_factory.mktemp("tiny-bamba"))


@pytest.fixture(scope="session")
def scheduler_address() -> Iterator[str]:
    server, port, _ = create_server("127.0.0.1", 0)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


@dataclass
class Worker:
    address: str
    engine: Engine
    stub: pb_grpc.GenerationStub

    def info(self) -> pb.GetInfoResponse:
        return self.stub.GetInfo(pb.GetInfoRequest(), timeout=5)


def budget_for_pages(runner_config: RunnerConfig, checkpoint: Path, num_pages: int) -> int:
    """The memory budget that leaves exactly num_pages KV pages."""
    probe = ModelRunner.from_model_dir(checkpoint, runner_config)
    slots = runner_config.max_num_seqs + runner_config.num_checkpoint_slots + runner_config.num_draft_rows
    state = probe.state_bytes_per_request * slots
    return state + num_pages * probe.kv_bytes_per_token * runner_config.kv_page_size_tokens


@pytest.fixture
def start_worker(checkpoint, scheduler_address) -> Iterator[Callable[..., Worker]]:
    """Starts a worker; keyword arguments override EngineSettings fields (and num_kv_pages); an
    observer, when given, watches its engine."""
    yield from _workers(checkpoint, scheduler_address)


@pytest.fixture(scope="module")
def start_module_worker(checkpoint, scheduler_address) -> Iterator[Callable[..., Worker]]:
    """`start_worker` for the workers a whole module shares (stopped after its last test)."""
    yield from _workers(checkpoint, scheduler_address)


def _workers(checkpoint: Path, scheduler_address: str) -> Iterator[Callable[..., Worker]]:
    started: list[tuple[grpc.Server, Engine, grpc.Channel, SchedulerClient]] = []

    def start(
        num_kv_pages: int | None = None,
        scheduler: SchedulerConfig = SCHEDULER,
        prefix_caching: bool = False,
        observer: EngineObserver | None = None,
        access: SharedTierAccess | None = SHARED_ACCESS,
        runner: dict[str, object] | None = None,
        **overrides,
    ) -> Worker:
        """`runner`: RunnerConfig fields (model processes among them: build_runner)."""
        scheduler = replace(scheduler, stop_at_last_boundary=prefix_caching)
        runner_config = RunnerConfig(
            memory_budget_bytes=16 << 20, kv_page_size_tokens=scheduler.kv_page_size,
            max_num_seqs=scheduler.max_num_seqs, num_checkpoint_slots=16, device="cpu", dtype="float32",
        )  # fmt: skip
        runner_config = replace(runner_config, **(runner or {}))  # type: ignore[arg-type]
        if num_kv_pages is not None:
            runner_config = replace(
                runner_config, memory_budget_bytes=budget_for_pages(runner_config, checkpoint, num_kv_pages)
            )
        settings = EngineSettings(
            scheduler=scheduler, runner=runner_config, scheduler_addresses=(scheduler_address,),
        )  # fmt: skip
        settings = replace(settings, **overrides)
        client = SchedulerClient(
            settings.scheduler_addresses, deadline_s=settings.scheduler_deadline_s,
            give_up_after_s=settings.scheduler_give_up_s, backoff_s=0.02, max_backoff_s=0.2,
        )  # fmt: skip
        model = build_runner(checkpoint, runner_config)
        prefix = build_prefix_cache(model, settings, prefix_caching, access)
        engine = Engine(model, client.plan, settings, observer=observer, prefix=prefix)
        engine.start()
        server, port, _ = grpc_server.create_server([add_to_server(GenerationServicer(engine, "tiny"))])
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        started.append((server, engine, channel, client))
        return Worker(f"127.0.0.1:{port}", engine, pb_grpc.GenerationStub(channel))

    yield start
    for server, engine, channel, client in started:
        channel.close()
        server.stop(None)
        engine.stop()
        client.close()
        if isinstance(engine.runner, ProcessRunner):
            engine.runner.close()


def greedy_request(prompt_ids: list[int], max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt_ids),
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
    )


def collect(stream) -> tuple[list[int], list[pb.GenerateResponse]]:
    messages = list(stream)
    return [t for m in messages for t in m.token_ids], messages


def hf_greedy(hf_model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    import torch

    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt_ids) :].tolist()


def prompt_of(length: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, SPEC.vocab_size) for _ in range(length)]
