"""The whole stack as real processes for fault tests and bench/bench_faults.py: Redis, the cache
service, a scheduler and a worker (on the stack launcher), each on a port picked once so a killed one comes back at its
address; N concurrent greedy streams whose outcomes are sorted into completed (the reference
tokens), a clear error status, hung (the deadline passed, or no answer) and wrong output."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridserve.children import Child, free_ports
from hybridserve.grpc_auth import with_bearer
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint
from hybridserve_cli.stack import Stack as Launcher

# Small enough for 64 streams on two shared CPU cores; the byte tokenizer, a 16-token cache block.
# The worker's pool is small too (--memory-budget-mb 2: about 550 KV pages), so a run evicts.
SPEC = ModelSpec(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=(1, 3), mamba_n_heads=4,
    mamba_d_state=16,
)  # fmt: skip
BLOCK_SIZE = 16
MAX_MEMORY_MB = 64  # the cache service's Redis budget
CLUSTER_TOKEN = "fault-suite-cluster-token"  # the cache service requires it; the worker and the tests send it
SECRETS = {
    "HYBRIDSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN,
    "HYBRIDSERVE_WORKER_CHECKPOINT_KEY": "fault-suite-checkpoint-key",
}
KV_PAGE_SIZE = 4
# The worker's local prefix tier holds at most this many blocks (one Mamba checkpoint each), fewer
# than 64 prompts have: each run evicts, and misses go to the shared tier (cache service, Redis).
CHECKPOINT_SLOTS = 32
CLEAR_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED,
})  # fmt: skip
COMPONENTS = ("scheduler", "worker", "cache", "redis")


def prompts(count: int, length: int = 40, seed: int = 0) -> list[list[int]]:
    """Distinct token-id prompts, several blocks long (so the shared tier has blocks to hold)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(count)]


def greedy(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


@dataclass
class Outcome:
    kind: str  # "completed", "clear error", "hung", "wrong output"
    elapsed_s: float
    tokens: list[int] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    details: str = ""


def classify(
    tokens: list[int], last: pb.GenerateResponse | None, error: grpc.RpcError | None, expected: list[int] | None
) -> tuple[str, grpc.StatusCode | None, str]:
    if error is not None:
        code, details = error.code(), error.details() or ""
        if code in CLEAR_CODES and details:
            return "clear error", code, details
        return ("hung" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "unclear error"), code, details
    if last is None or last.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        return "wrong output", None, "the stream ended without a finish reason"
    if expected is not None and tokens != expected:
        return "wrong output", None, f"tokens {tokens} != reference {expected}"
    return "completed", None, ""


def run_streams(
    address: str,
    requests: Sequence[list[int]],
    max_tokens: int,
    deadline_s: float,
    expected: Sequence[list[int]] | None = None,
    during: Callable[[], None] | None = None,
) -> list[Outcome]:
    """One stream per prompt, all at once (each on a thread, one channel); `during` runs on this
    thread while they are in flight. Returns each stream's outcome, in prompt order."""
    outcomes: list[Outcome | None] = [None] * len(requests)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        def one(i: int) -> None:
            start = time.monotonic()
            tokens: list[int] = []
            last: pb.GenerateResponse | None = None
            error: grpc.RpcError | None = None
            try:
                for message in stub.Generate(greedy(requests[i], max_tokens), timeout=deadline_s):
                    tokens.extend(message.token_ids)
                    last = message
            except grpc.RpcError as exc:
                error = exc
            kind, code, details = classify(tokens, last, error, None if expected is None else expected[i])
            outcomes[i] = Outcome(kind, time.monotonic() - start, tokens, code, details)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(requests))]
        for t in threads:
            t.start()
        if during is not None:
            during()
        for t in threads:
            t.join(deadline_s + 30)  # a thread still alive here is a client hung past its own deadline
    return [o if o is not None else Outcome("hung", float("inf")) for o in outcomes]


def tally(outcomes: Sequence[Outcome]) -> Counter[str]:
    return Counter(o.kind for o in outcomes)


@dataclass(frozen=True)
class RedisAt:
    """The stack's Redis, for a test's own client."""

    port: int

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port)


class Stack:
    """Redis, cache service, scheduler and worker processes on the stack launcher
    (hybridserve_cli/stack.py), each on a port picked once; `kill(name)` is kill -9 and `start(name)`
    brings it back on the same port."""

    def __init__(self, model_dir: Path, worker_flags: Sequence[str] = ()) -> None:
        self.model_dir = model_dir
        self.worker_flags = list(worker_flags)
        *ports, self.redis_port = free_ports(4)  # distinct, unlike ports asked for one at a time
        self.ports = dict(zip(("scheduler", "worker", "cache"), ports, strict=True))
        # this process runs gRPC: no death signal; every line kept, for failure messages
        self.launcher = Launcher(start_timeout_s=180, stop_timeout_s=30, die_with_parent=False, keep_lines=100_000)
        try:
            for name in COMPONENTS[::-1]:  # redis, cache, worker's dependencies first
                if name != "worker":
                    self.start(name)
            self.start("worker")
        except BaseException:
            self.stop()
            raise

    @property
    def worker_address(self) -> str:
        return f"127.0.0.1:{self.ports['worker']}"

    @property
    def cache_address(self) -> str:
        return f"127.0.0.1:{self.ports['cache']}"

    @property
    def procs(self) -> dict[str, Child]:
        """The running services other than Redis, by name."""
        return {s.name: s.child for s in self.launcher.running() if s.name != "redis"}

    @property
    def redis(self) -> RedisAt | None:
        running = any(s.name == "redis" for s in self.launcher.running())
        return RedisAt(self.redis_port) if running else None

    def start(self, name: str) -> None:
        if any(s.name == name for s in self.launcher.services):
            self.launcher.restart(name)
            return
        stack = self.launcher
        if name == "redis":
            stack.redis(port=self.redis_port)
        elif name == "scheduler":
            stack.scheduler(self.ports["scheduler"])
        elif name == "cache":
            stack.cache(f"redis://127.0.0.1:{self.redis_port}/0", self.ports["cache"],
                        ["--max-memory-mb", str(MAX_MEMORY_MB)], env=SECRETS)  # fmt: skip
        else:
            stack.worker(self.model_dir, [f"127.0.0.1:{self.ports['scheduler']}"], self.cache_address,
                         self.ports["worker"], [
                "--device", "cpu", "--memory-budget-mb", "2", "--max-num-seqs", "16", "--max-queue-len", "64",
                "--block-size", str(BLOCK_SIZE), "--mamba-block-size", "8", "--kv-page-size", str(KV_PAGE_SIZE),
                "--num-checkpoint-slots", str(CHECKPOINT_SLOTS), "--scheduler-give-up-s", "20", *self.worker_flags,
            ], env=SECRETS)  # fmt: skip

    @contextlib.contextmanager
    def cache_channel(self) -> Iterator[grpc.Channel]:
        """A channel to the cache service that sends the cluster token."""
        with grpc.insecure_channel(self.cache_address) as channel:
            yield with_bearer(channel, CLUSTER_TOKEN)

    def kill(self, name: str) -> None:
        self.launcher.kill(name)

    def terminate(self, name: str) -> int:
        """SIGTERM (a rolling restart): the process drains and exits; returns its exit code."""
        return self.launcher.terminate(name)

    def stop(self) -> None:
        self.launcher.stop()

    def info(self, timeout_s: float = 5.0) -> pb.GetInfoResponse:
        with grpc.insecure_channel(self.worker_address) as channel:
            return pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest(), timeout=timeout_s)

    def wait_quiet(self, timeout_s: float = 30.0) -> pb.GetInfoResponse:
        """GetInfo once the worker is warm and runs and queues nothing (or the last answer at the timeout):
        a restarted worker's warm-up steps hold borrowed pages and slots until it is warm."""
        deadline = time.monotonic() + timeout_s
        info = self.info()
        while (info.num_running or info.num_waiting or info.warmup_state == "warming") and time.monotonic() < deadline:
            time.sleep(0.1)
            info = self.info()
        return info

    def wait_progress(self, tokens: int, timeout_s: float = 60.0) -> None:
        """Blocks until the worker generated `tokens` more tokens than when called."""
        start = self.info().num_generated_tokens
        deadline = time.monotonic() + timeout_s
        while self.info().num_generated_tokens < start + tokens:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker generated fewer than {tokens} tokens in {timeout_s:.0f} s")
            time.sleep(0.02)


def health_check_s(address: str, service: str = "readiness", timeout_s: float = 5.0) -> tuple[float, int | None]:
    """(seconds one grpc.health.v1 Check took, its status or None on an error) on a fresh channel."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        start = time.monotonic()
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status
        except grpc.RpcError:
            status = None
        return time.monotonic() - start, status


def serves(address: str, prompt: list[int], max_tokens: int, timeout_s: float) -> list[int] | None:
    """The tokens of one request, retried until timeout_s (None if none succeeded): recovery."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(address) as channel:
                stream = pb_grpc.GenerationStub(channel).Generate(
                    greedy(prompt, max_tokens), timeout=max(deadline - time.monotonic(), 0.1)
                )
                return [t for m in stream for t in m.token_ids]
        except grpc.RpcError:
            time.sleep(0.05)
    return None


def write_model(folder: Path) -> Path:
    return write_random_checkpoint(folder / "tiny", SPEC, seed=11)


def health_status_name(status: int | None) -> str:
    return "error" if status is None else health_pb2.HealthCheckResponse.ServingStatus.Name(status)


GATEWAY_KEYS = ("hostile-key-a", "hostile-key-b")  # the gateway accepts both; a request's creator is one of them


def start_gateway(stack: Stack, flags: Sequence[str] = (), timeout_s: float = 60.0) -> tuple[str, str]:
    """A gateway in front of the stack's worker (its tokenizer from the model, API keys GATEWAY_KEYS, a
    17 MiB body limit so a 16 MiB body reaches the handlers); (HTTP address, gRPC address) once ready."""
    import urllib.request

    service = stack.launcher.gateway(
        [stack.worker_address],
        flags=["--model", str(stack.model_dir), "--max-body-mb", "17", *flags],
        env={"HYBRIDSERVE_API_KEYS": ",".join(GATEWAY_KEYS)},
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://{service.address}/ready", timeout=2) as response:
                if response.status == 200:
                    return service.address, service.grpc_address
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway admitted no worker within {timeout_s:.0f} s")
        time.sleep(0.1)


def http_health_s(address: str, timeout_s: float = 10.0) -> float:
    """Seconds one GET /health took on a fresh connection (inf when it failed)."""
    import urllib.request

    start = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout_s) as response:
            response.read()
            return time.monotonic() - start if response.status == 200 else float("inf")
    except OSError:
        return float("inf")
