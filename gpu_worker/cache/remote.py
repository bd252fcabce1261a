"""The worker's client of the shared tier (cache_svc). Publishing happens on a background thread,
off the step's critical path; lookups and fetches run on a small pool so the engine never waits on
the network. Every failure (cache_svc or Redis down, a damaged checkpoint) is a miss, logged once
per outage; the gRPC channel reconnects by itself when the service returns.

The tier is untrusted storage: checkpoints are sealed with the workers' key and verified here, on
the fetch thread, before anything touches a pool (checkpoint_io). One that fails is a miss, counted
by reason (`rejected`, and hybridserve_checkpoints_rejected_total when metrics are on) and deleted."""

from __future__ import annotations

import collections
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc
from opentelemetry import context as otel_context
from prometheus_client import Counter

from gpu_worker.cache.checkpoint_io import (
    BlockCheckpoint,
    BlockIdentity,
    CheckpointLayout,
    Rejection,
    check_key,
    seal,
    verify,
)
from hybridserve import telemetry
from hybridserve.grpc_auth import with_bearer
from hybridserve.metrics import process_registry
from hybridserve.tls import TlsSettings, open_channel
from hybridserve.v1 import cache_pb2 as pb
from hybridserve.v1 import cache_pb2_grpc as pb_grpc

log = logging.getLogger("hybridserve.cache.client")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class FetchedBlock:
    block_hash: bytes
    parent_hash: bytes
    checkpoint: BlockCheckpoint


@dataclass(frozen=True, slots=True)
class SharedTierAccess:
    """What a worker needs to use the shared tier safely."""

    checkpoint_key: bytes  # the workers' MAC key (>= 16 bytes); the tier never sees it
    cluster_token: str | None = None  # sent on every BlockCache call
    tls: TlsSettings | None = None  # how to dial the cache service


class SharedTier:
    def __init__(
        self,
        address: str,
        fingerprint: str,
        block_size: int,
        layout: CheckpointLayout,
        access: SharedTierAccess,
        deadline_s: float = 1.0,
        max_pending: int = 256,
    ) -> None:
        self.address = address
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.layout = layout
        self._key = check_key(access.checkpoint_key)
        self.deadline_s = deadline_s
        self._channel = open_channel(address, access.tls)
        channel = with_bearer(telemetry.intercept_channel(self._channel), access.cluster_token)
        self._stub = pb_grpc.BlockCacheStub(channel)  # type: ignore[no-untyped-call]
        self._publish_queue: queue.Queue[tuple[bytes, bytes, BlockCheckpoint] | None] = queue.Queue(max_pending)
        self._fetch_pool = ThreadPoolExecutor(2, thread_name_prefix="cache-fetch")
        self._publisher = threading.Thread(target=self._publish_loop, name="cache-publish", daemon=True)
        self._publisher.start()
        self._healthy = True
        self.num_published = 0
        self.rejected: collections.Counter[str] = collections.Counter()  # refused checkpoints, by reason
        self._rejected_metric = _rejected_counter()

    # ---- publish (engine thread enqueues, the publisher sends) ------------------------------------
    def publish(self, block_hash: bytes, parent_hash: bytes, checkpoint: BlockCheckpoint) -> None:
        try:
            self._publish_queue.put_nowait((block_hash, parent_hash, checkpoint))
        except queue.Full:
            log.debug("publish queue full; dropping block %s", block_hash.hex()[:12])

    def _publish_loop(self) -> None:
        while (item := self._publish_queue.get()) is not None:
            try:
                self._publish_one(*item)
            finally:
                self._publish_queue.task_done()
        self._publish_queue.task_done()

    def _publish_one(self, block_hash: bytes, parent_hash: bytes, checkpoint: BlockCheckpoint) -> None:
        data = seal(checkpoint, self._identity(block_hash, parent_hash), self._key)
        checksum = hashlib.sha256(data).digest()  # transit only: the MAC is what makes it trustworthy
        request = pb.PublishRequest(
            model_fingerprint=self.fingerprint, block_hash=block_hash, parent_hash=parent_hash,
            block_size=self.block_size, checkpoint=data, checksum=checksum,
        )  # fmt: skip
        if self._call(lambda: self._stub.Publish(request, timeout=self.deadline_s * 5)) is not None:
            self.num_published += 1

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits until every queued publish was sent or failed; False on timeout (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._publish_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._publish_queue.unfinished_tasks

    # ---- lookup + fetch (off the engine thread) ----------------------------------------------------
    def fetch_prefix(
        self, block_hashes: list[bytes], num_local_blocks: int, trace_context: object | None = None
    ) -> Future[list[FetchedBlock]]:
        """Fetches the blocks after the first num_local_blocks that the shared tier holds; the cache
        calls are traced as children of `trace_context` (the request's span) when given."""
        return self._fetch_pool.submit(self._fetch_traced, trace_context, block_hashes, num_local_blocks)

    def _fetch_traced(
        self, trace_context: object | None, block_hashes: list[bytes], num_local_blocks: int
    ) -> list[FetchedBlock]:
        token = otel_context.attach(trace_context) if trace_context is not None else None  # type: ignore[arg-type]
        try:
            return self._fetch_prefix(block_hashes, num_local_blocks)
        finally:
            if token is not None:
                otel_context.detach(token)

    def _fetch_prefix(self, block_hashes: list[bytes], num_local_blocks: int) -> list[FetchedBlock]:
        lookup = pb.LookupRequest(model_fingerprint=self.fingerprint, block_hashes=block_hashes)
        found = self._call(lambda: self._stub.Lookup(lookup, timeout=self.deadline_s))
        if found is None or found.num_hit_blocks <= num_local_blocks:
            return []
        fetched: list[FetchedBlock] = []
        for index in range(num_local_blocks, min(found.num_hit_blocks, len(block_hashes))):
            parent = block_hashes[index - 1] if index else b""
            checkpoint = self._fetch_one(self._identity(block_hashes[index], parent))
            if checkpoint is None:
                break
            fetched.append(FetchedBlock(block_hashes[index], parent, checkpoint))
        while fetched and not fetched[-1].checkpoint.has_state:
            fetched.pop()  # a hit must end on the state at its boundary: KV alone is a miss
        return fetched

    def _identity(self, block_hash: bytes, parent_hash: bytes) -> BlockIdentity:
        return BlockIdentity(block_hash, parent_hash, self.block_size, self.fingerprint)

    def _fetch_one(self, identity: BlockIdentity) -> BlockCheckpoint | None:
        request = pb.FetchRequest(model_fingerprint=self.fingerprint, block_hash=identity.block_hash)

        def fetch() -> tuple[bytes, bytes]:
            chunks, checksum = [], b""
            for chunk in self._stub.Fetch(request, timeout=self.deadline_s * 5):
                if chunk.WhichOneof("part") == "header":
                    checksum = chunk.header.checksum
                else:
                    chunks.append(chunk.data)
            return b"".join(chunks), checksum

        got = self._call(fetch)
        if got is None:
            return None
        data, checksum = got
        if hashlib.sha256(data).digest() != checksum:
            verdict: BlockCheckpoint | Rejection = Rejection("checksum", "damaged in transit")
        else:
            verdict = verify(data, identity, self.layout, self._key)
        if isinstance(verdict, Rejection):
            self._reject(identity.block_hash, verdict)
            return None
        return verdict

    def _reject(self, block_hash: bytes, rejection: Rejection) -> None:
        """Counts a refused checkpoint and deletes it from the tier (it would fail every worker)."""
        self.rejected[rejection.reason] += 1
        if self._rejected_metric is not None:
            self._rejected_metric.labels(rejection.reason).inc()
        log.warning("refusing shared-tier checkpoint %s: %s; deleting it", block_hash.hex()[:12], rejection)
        request = pb.DeleteRequest(model_fingerprint=self.fingerprint, block_hash=block_hash, reason=rejection.reason)
        self._call(lambda: self._stub.Delete(request, timeout=self.deadline_s))

    def _call(self, fn: Callable[[], T]) -> T | None:
        """fn() or, when the shared tier fails, None (logged once per outage)."""
        try:
            result = fn()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND and self._healthy:
                log.warning("shared cache tier at %s unavailable (%s); serving misses", self.address, err.code().name)
                self._healthy = False
            return None
        if not self._healthy:
            log.info("shared cache tier at %s is back", self.address)
            self._healthy = True
        return result

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    def close(self) -> None:
        self._publish_queue.put(None)
        self._publisher.join(5)
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        self._channel.close()


def _rejected_counter() -> Counter | None:
    """hybridserve_checkpoints_rejected_total{reason} in the process registry (None while metrics
    are off); created once per registry."""
    registry = process_registry()
    if registry is None:
        return None
    with _metric_lock:
        found = _rejected_metrics.get(id(registry))
        if found is None:
            found = _rejected_metrics[id(registry)] = Counter(
                "hybridserve_checkpoints_rejected", "shared-tier checkpoints refused by this worker (misses, deleted)",
                ["reason"], registry=registry,
            )  # fmt: skip
        return found


_metric_lock = threading.Lock()
_rejected_metrics: dict[int, Counter] = {}
