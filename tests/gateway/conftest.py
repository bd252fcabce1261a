"""Real processes for the gateway tests: a scheduler, two workers and a gateway, each a `hybridserve`
child on port 0 (workers on ports picked here, so a killed worker can come back at its address)."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from hybridserve.children import free_ports
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint
from tests.procs import ServerProcess

# Small enough that two workers and a gateway share two CPU cores in a test; a 16-token cache block
# makes caching show with prompts of a few dozen bytes (the byte tokenizer: one token per byte).
SPEC = ModelSpec(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    attn_layer_indices=(1, 3),
    mamba_n_heads=4,
    mamba_d_state=16,
)
BLOCK_SIZE = 16
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
API_KEY = "test-key-123"
MODEL_NAME = "tiny"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """init-model's checkpoint format with a chat template added (init-model writes none)."""
    root = write_random_checkpoint(tmp_path_factory.mktemp("gateway-model") / "tiny", SPEC, seed=3)
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="session")
def scheduler() -> Iterator[ServerProcess]:
    with ServerProcess(["scheduler", "--port", "0"]) as proc:
        yield proc


def worker_args(model_dir: Path, scheduler_address: str, port: int, *extra: str) -> list[str]:
    return [
        "worker",
        "--model",
        str(model_dir),
        "--scheduler",
        scheduler_address,
        "--port",
        str(port),
        "--device",
        "cpu",
        "--memory-budget-mb",
        "24",
        "--max-num-seqs",
        "2",
        "--block-size",
        str(BLOCK_SIZE),
        "--mamba-block-size",
        "8",
        "--num-checkpoint-slots",
        "64",
        "--max-queue-len",
        "64",
        *extra,
    ]


def start_worker(model_dir: Path, scheduler_address: str, port: int, *extra: str) -> ServerProcess:
    """A worker; flags in `extra` override the defaults above (argparse keeps the last)."""
    return ServerProcess(worker_args(model_dir, scheduler_address, port, *extra), timeout_s=120)


def start_gateway(
    workers: list[str], model_dir: Path | None, *extra: str, env: dict[str, str] | None = None
) -> ServerProcess:
    """A gateway in front of `workers`; with `model_dir` None, started without --model (it takes the model's
    files from its workers)."""
    model = ["--model", str(model_dir)] if model_dir is not None else []
    return ServerProcess(
        ["gateway", "--workers", ",".join(workers), "--port", "0", "--grpc-port", "0", *model,
         "--served-model-name", MODEL_NAME, *extra],
        env=env,
    )  # fmt: skip


def grpc_address(gateway: ServerProcess) -> str:
    for line in gateway.lines:
        if line.startswith("grpc listening on "):
            return line.split()[-1]
    raise AssertionError(gateway.output)


def wait_ready(gateway: ServerProcess, num_workers: int, timeout_s: float = 30.0) -> dict[str, bool]:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://{gateway.address}/ready", timeout=5) as response:
                body = json.loads(response.read())
        except OSError:
            body = {"workers": {}}
        if sum(body["workers"].values()) >= num_workers:
            return body["workers"]
        if time.monotonic() > deadline:
            raise AssertionError(f"{num_workers} workers not ready: {body}\n{gateway.output}")
        time.sleep(0.1)


def generated_tokens(address: str) -> int:
    """The worker's count of tokens generated since it started."""
    with grpc.insecure_channel(address) as channel:
        return int(pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest(), timeout=10).num_generated_tokens)


@dataclass
class Stack:
    scheduler: ServerProcess
    workers: list[ServerProcess]
    worker_addresses: list[str]
    gateway: ServerProcess

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway.address}/v1"


@contextlib.contextmanager
def gateway_stack(
    model_dir: Path,
    scheduler: ServerProcess,
    *gateway_extra: str,
    env: dict[str, str] | None = None,
    gateway_model: bool = True,
) -> Iterator[Stack]:
    """Two workers of `model_dir` behind a gateway (given --model unless `gateway_model` is False); every
    process stops, also when one of them fails to start."""
    ports = free_ports(2)  # distinct
    addresses = [f"127.0.0.1:{p}" for p in ports]
    workers: list[ServerProcess] = []
    try:
        for port in ports:
            workers.append(start_worker(model_dir, scheduler.address, port))
        gateway = start_gateway(addresses, model_dir if gateway_model else None, *gateway_extra, env=env)
        try:
            wait_ready(gateway, 2)
            yield Stack(scheduler, workers, addresses, gateway)
        finally:
            assert gateway.stop() == 0, gateway.output
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture(scope="module")
def stack(model_dir, scheduler) -> Iterator[Stack]:
    """Two workers behind a gateway that requires API_KEY."""
    with gateway_stack(model_dir, scheduler, "--max-body-mb", "0.05", env={"HYBRIDSERVE_API_KEYS": API_KEY}) as s:
        yield s
