"""The workers behind the gateway: one grpc.aio channel each, a health poll, and their load.

`--workers` lists addresses; a host name that resolves to several addresses (a compose service, a
Kubernetes headless service) stands for one worker per address, re-resolved every
`resolve_interval_s`. Every `poll_interval_s` each worker is asked for its readiness
(grpc.health.v1, the empty service name) and its load (GetInfo: running + waiting). A worker that
cannot be reached (UNAVAILABLE: dead, refused, reset) or says it is not serving is out of rotation at
once; one that is only slow to answer (a busy worker answers late) is out after `max_slow_polls`
polls in a row time out. Either is back when a poll succeeds again. With `files_hash` set (a gateway
without --model, gateway/model_files.py), a worker is in rotation only while its GetInfo reports that
model_files_hash; "" holds every worker out until one is adopted. Runs on the gateway's event loop only."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridserve.tls import TlsSettings, open_aio_channel
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("hybridserve.gateway.pool")

# A restarted worker must be dialled again within a poll or two, not after gRPC's default reconnect
# backoff (up to two minutes); retries are the dispatcher's business, not the channel's.
CHANNEL_OPTIONS = (
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


@dataclass(eq=False)
class WorkerState:
    """One worker address and what the gateway knows of it."""

    address: str  # host:port dialled
    channel: grpc.aio.Channel
    stub: pb_grpc.GenerationStub
    health: health_pb2_grpc.HealthStub
    is_ready: bool = False
    num_in_flight: int = 0  # requests the gateway has open on it now
    num_queued_prefill_tokens: int = 0  # estimated prompt tokens of those, not yet streaming
    num_other_active: int = 0  # running + waiting at the last poll, less the gateway's own then
    num_slow_polls: int = 0  # polls in a row that timed out
    files_refusal: str = ""  # why its model files keep it out of rotation, as last logged ("" = they do not)
    info: pb.GetInfoResponse | None = None

    @property
    def num_active_requests(self) -> int:
        """Load for routing: the gateway's own open requests (exact, current) plus those of other
        clients as of the last poll (a poll lags; counting the gateway's requests from it would make
        a worker look busy with requests that just finished)."""
        return self.num_in_flight + self.num_other_active


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"worker address {address!r} must be HOST:PORT")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class WorkerPool:
    specs: Sequence[str]  # the --workers entries, HOST:PORT each
    poll_interval_s: float = 0.25
    poll_timeout_s: float = 1.0
    max_slow_polls: int = 3
    resolve_interval_s: float = 5.0
    metadata: tuple[tuple[str, str], ...] = ()  # sent on every call (a worker API key)
    on_down: Callable[[str], None] | None = None  # called when a worker leaves the rotation
    tls: TlsSettings | None = None  # how to dial the workers (plaintext unless tls.tls_ca is set)
    # None: any worker serves (the gateway has --model); else only workers reporting this model_files_hash,
    # and none while it is "" (not adopted yet)
    files_hash: str | None = None
    workers: dict[str, WorkerState] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _last_resolved: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for spec in self.specs:
            split_host_port(spec)  # fails early on a malformed address

    async def start(self) -> None:
        await self._resolve()
        await self._poll_all()
        self._task = asyncio.create_task(self._run(), name="worker-pool")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for worker in self.workers.values():
            await worker.channel.close(None)

    def adopt_files_hash(self, files_hash: str) -> None:
        """From now on, workers reporting `files_hash` go into rotation (at their next poll)."""
        self.files_hash = files_hash
        self._changed.set()

    def _files_refusal(self, info: pb.GetInfoResponse) -> str:
        """Why a worker's model files keep it out of rotation; "" when they do not."""
        if self.files_hash is None or info.model_files_hash == self.files_hash:
            return ""
        if not self.files_hash:
            return "waiting for the model files (this gateway has no --model)"
        theirs = info.model_files_hash[:16] or "none"
        return (
            f"it serves model files {theirs}, not the {self.files_hash[:16]} this gateway adopted (another tokenizer,"
            " chat template or generation defaults would serve prompts differently); restart the gateway to adopt"
            " new files, or start it with --model"
        )

    def ready(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.is_ready]

    def mark_down(self, address: str, why: str) -> None:
        """A call failed with UNAVAILABLE: out of rotation until a poll succeeds."""
        worker = self.workers.get(address)
        if worker is not None and worker.is_ready:
            worker.is_ready = False
            log.warning("worker %s out of rotation: %s", address, why)
            if self.on_down is not None:
                self.on_down(address)
            self._changed.set()

    async def wait_ready(self, timeout_s: float) -> bool:
        """Waits until some worker is ready (or timeout_s passes)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.ready():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, self.poll_interval_s))
        return True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_resolve = loop.time() + self.resolve_interval_s
        while True:
            await asyncio.sleep(self.poll_interval_s)
            if loop.time() >= next_resolve:
                await self._resolve()
                next_resolve = loop.time() + self.resolve_interval_s
            await self._poll_all()

    async def _addresses(self, spec: str) -> list[str]:
        host, port = split_host_port(spec)
        if _is_ip(host):
            return [_join(host, port)]
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("cannot resolve worker %s (keeping its last addresses): %s", spec, exc)
            return self._last_resolved.get(spec, [])
        addresses = sorted({_join(str(info[4][0]), port) for info in infos})
        self._last_resolved[spec] = addresses
        return addresses

    async def _resolve(self) -> None:
        """One worker per resolved address: new ones get a channel, vanished ones are closed."""
        wanted: set[str] = set()
        for spec in self.specs:
            wanted.update(await self._addresses(spec))
        for address in sorted(wanted - set(self.workers)):
            channel = open_aio_channel(address, self.tls, CHANNEL_OPTIONS)
            stub = pb_grpc.GenerationStub(channel)  # type: ignore[no-untyped-call]
            self.workers[address] = WorkerState(address, channel, stub, health_pb2_grpc.HealthStub(channel))
            log.info("worker %s added", address)
        for address in sorted(set(self.workers) - wanted):
            worker = self.workers.pop(address)
            self.mark_down(address, "no longer resolved")
            await worker.channel.close(None)
            log.info("worker %s removed", address)

    async def _poll_all(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in list(self.workers.values())))

    async def _poll(self, worker: WorkerState) -> None:
        try:
            check = await worker.health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self.poll_timeout_s, metadata=self.metadata
            )
            if check.status != health_pb2.HealthCheckResponse.SERVING:
                self.mark_down(worker.address, "not ready (draining or starting)")
                return
            info = await worker.stub.GetInfo(pb.GetInfoRequest(), timeout=self.poll_timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            slow = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            worker.num_slow_polls = worker.num_slow_polls + 1 if slow else 0
            if not slow or worker.num_slow_polls >= self.max_slow_polls:
                self.mark_down(worker.address, f"{exc.code().name}: {exc.details()}")
            return
        worker.num_slow_polls = 0
        worker.info = info
        worker.num_other_active = max(0, int(info.num_running + info.num_waiting) - worker.num_in_flight)
        refusal = self._files_refusal(info)
        if refusal:
            if worker.is_ready:
                self.mark_down(worker.address, refusal)
            elif refusal != worker.files_refusal and self.files_hash:
                log.error("worker %s out of rotation: %s", worker.address, refusal)
            worker.files_refusal = refusal
            return
        worker.files_refusal = ""
        if not worker.is_ready:
            log.info("worker %s in rotation (model %s, block size %d)", worker.address, info.model, info.block_size)
            worker.is_ready = True
            self._changed.set()
