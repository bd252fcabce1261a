"""The worker's client of the shared tier (cache_svc). Publishing happens on a background thread,
off the step's critical path; lookups and fetches run on a small pool so the engine never waits on
the network. Lookups and writes go to the service (Publish enforces its bounds); checkpoint bytes
are read directly from Redis when the service grants access (cache_svc/client.py: pipelined batches
for a run of blocks, each verified here while the next is read), else streamed by its Fetch. Every
failure (cache_svc or Redis down, a damaged checkpoint) is a miss with its reason (misses.py),
logged once per outage; the gRPC channel reconnects by itself, and the direct path is asked for
again after it failed.

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

from cache_svc.client import StoredBlock
from gpu_worker.cache.direct_reads import DirectReads, Verified
from gpu_worker.cache.direct_reads import FetchedBlock as FetchedBlock
from gpu_worker.cache.misses import FetchOrRecompute, MissReason, reason_for_rejection
from gpu_worker.runner.checkpoint_io import (
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
_BLOCK_ERRORS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS)  # about one block, not the tier


@dataclass(frozen=True, slots=True)
class FetchResult:
    """What the shared tier gave for one request's prefix."""

    request_id: str
    blocks: list[FetchedBlock]  # verified, in order, the last with state (empty: none)
    miss_reason: MissReason | None  # why it gave no more (None: it held nothing more)
    decision: str  # "fetch" or "recompute" (fetch-or-recompute), "" when it held nothing to offer
    num_offered_blocks: int  # blocks it held beyond the local hit


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
        access_request = pb.AccessRequest(model_fingerprint=fingerprint)
        self._direct = DirectReads(
            lambda: self._try(lambda: self._stub.Access(access_request, timeout=self.deadline_s)),
            self._verify_rows, socket_timeout_s=deadline_s * 5,
        )  # fmt: skip

    @property
    def uses_direct_path(self) -> bool:
        """Whether checkpoint bytes currently come directly from Redis."""
        return self._direct.active

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
        self,
        request_id: str,
        block_hashes: list[bytes],
        num_local_blocks: int,
        trace_context: object | None = None,
        policy: FetchOrRecompute | None = None,
    ) -> Future[FetchResult]:
        """Fetches the blocks after the first num_local_blocks that the shared tier holds, unless
        `policy` expects computing them to be faster; the cache calls are traced as children of
        `trace_context` (the request's span) when given."""
        return self._fetch_pool.submit(
            self._fetch_traced, trace_context, request_id, block_hashes, num_local_blocks, policy
        )

    def _fetch_traced(
        self,
        trace_context: object | None,
        request_id: str,
        block_hashes: list[bytes],
        num_local_blocks: int,
        policy: FetchOrRecompute | None,
    ) -> FetchResult:
        token = otel_context.attach(trace_context) if trace_context is not None else None  # type: ignore[arg-type]
        try:
            return self._fetch_prefix(request_id, block_hashes, num_local_blocks, policy)
        finally:
            if token is not None:
                otel_context.detach(token)

    def _fetch_prefix(
        self, request_id: str, block_hashes: list[bytes], num_local_blocks: int, policy: FetchOrRecompute | None
    ) -> FetchResult:
        lookup = pb.LookupRequest(model_fingerprint=self.fingerprint, block_hashes=block_hashes)
        found, _ = self._try(lambda: self._stub.Lookup(lookup, timeout=self.deadline_s))
        if found is None:
            return FetchResult(request_id, [], MissReason.SHARED_TIER_DOWN, "", 0)
        end = min(found.num_hit_blocks, len(block_hashes))
        offered = end - num_local_blocks
        if offered <= 0:
            return FetchResult(request_id, [], None, "", 0)
        decision = policy.decide(offered) if policy is not None else None
        if decision is not None and not decision.fetch:
            return FetchResult(request_id, [], MissReason.FETCH_SLOWER, "recompute", offered)
        started = time.monotonic()
        direct = self._direct.path()
        hint = policy.bytes_per_block if policy is not None else 0
        got = self._direct.read(direct, block_hashes, num_local_blocks, end, hint) if direct is not None else None
        if got is None:  # no direct path, or it failed: through the service
            got = self._read_via_service(block_hashes, num_local_blocks, end)
        fetched, reason, num_bytes = got
        if policy is not None:
            policy.record_fetch(num_bytes, time.monotonic() - started)
        while fetched and not fetched[-1].checkpoint.has_state:
            fetched.pop()  # a hit must end on the state at its boundary: KV alone is a miss
            reason = reason or MissReason.KV_WITHOUT_STATE
        return FetchResult(request_id, fetched, reason, "fetch", offered)

    # ---- verification (the direct path's batches, on its verify threads) ----------------------------
    def _verify_rows(self, block_hashes: list[bytes], indices: range, rows: list[StoredBlock | None]) -> Verified:
        """Checks the rows read for `indices`: present, this model and schema, sealed by a worker."""
        fetched: list[FetchedBlock] = []
        num_bytes = 0
        for index, row in zip(indices, rows, strict=True):
            if row is None:
                return fetched, MissReason.EVICTED, num_bytes  # gone since the lookup
            parent = block_hashes[index - 1] if index else b""
            if row.oversized:
                self._reject(block_hashes[index], Rejection("format", "larger than this model's checkpoints"))
                return fetched, MissReason.FAILED_VERIFICATION, num_bytes
            if not row.is_current_schema or row.fingerprint != self.fingerprint:
                return fetched, MissReason.FOREIGN_FINGERPRINT, num_bytes
            verdict = verify(row.data, self._identity(block_hashes[index], parent), self.layout, self._key)
            if isinstance(verdict, Rejection):
                self._reject(block_hashes[index], verdict)
                return fetched, reason_for_rejection(verdict.reason), num_bytes
            num_bytes += len(row.data)
            fetched.append(FetchedBlock(block_hashes[index], parent, verdict))
        return fetched, None, num_bytes

    # ---- through the service ----------------------------------------------------------------------
    def _read_via_service(self, block_hashes: list[bytes], first: int, end: int) -> Verified:
        """Blocks [first, end) streamed by the service one by one; stops at the first bad one."""
        fetched: list[FetchedBlock] = []
        num_bytes = 0
        for index in range(first, end):
            parent = block_hashes[index - 1] if index else b""
            checkpoint, size, reason = self._fetch_one(self._identity(block_hashes[index], parent))
            if checkpoint is None:
                return fetched, reason, num_bytes
            num_bytes += size
            fetched.append(FetchedBlock(block_hashes[index], parent, checkpoint))
        return fetched, None, num_bytes

    def _identity(self, block_hash: bytes, parent_hash: bytes) -> BlockIdentity:
        return BlockIdentity(block_hash, parent_hash, self.block_size, self.fingerprint)

    def _fetch_one(self, identity: BlockIdentity) -> tuple[BlockCheckpoint | None, int, MissReason | None]:
        """(checkpoint, its size in bytes, None) or (None, 0, why not)."""
        request = pb.FetchRequest(model_fingerprint=self.fingerprint, block_hash=identity.block_hash)

        def fetch() -> tuple[bytes, bytes]:
            chunks, checksum = [], b""
            for chunk in self._stub.Fetch(request, timeout=self.deadline_s * 5):
                if chunk.WhichOneof("part") == "header":
                    checksum = chunk.header.checksum
                else:
                    chunks.append(chunk.data)
            return b"".join(chunks), checksum

        got, code = self._try(fetch)
        if got is None:
            return None, 0, _reason_for_status(code)
        data, checksum = got
        if hashlib.sha256(data).digest() != checksum:
            verdict: BlockCheckpoint | Rejection = Rejection("checksum", "damaged in transit")
        else:
            verdict = verify(data, identity, self.layout, self._key)
        if isinstance(verdict, Rejection):
            self._reject(identity.block_hash, verdict)
            return None, 0, reason_for_rejection(verdict.reason)
        return verdict, len(data), None

    def _reject(self, block_hash: bytes, rejection: Rejection) -> None:
        """Counts a refused checkpoint and deletes it from the tier (it would fail every worker)."""
        self.rejected[rejection.reason] += 1
        if self._rejected_metric is not None:
            self._rejected_metric.labels(rejection.reason).inc()
        log.warning("refusing shared-tier checkpoint %s: %s; deleting it", block_hash.hex()[:12], rejection)
        request = pb.DeleteRequest(model_fingerprint=self.fingerprint, block_hash=block_hash, reason=rejection.reason)
        self._call(lambda: self._stub.Delete(request, timeout=self.deadline_s))

    def _try(self, fn: Callable[[], T]) -> tuple[T | None, grpc.StatusCode | None]:
        """(fn(), None) or, when the call fails, (None, its status code)."""
        try:
            return self._call(fn, raise_errors=True), None
        except grpc.RpcError as err:
            return None, err.code()

    def _call(self, fn: Callable[[], T], raise_errors: bool = False) -> T | None:
        """fn() or, when the shared tier fails, None (logged once per outage); with raise_errors
        the RpcError is raised after logging."""
        try:
            result = fn()
        except grpc.RpcError as err:
            if err.code() not in (*_BLOCK_ERRORS, grpc.StatusCode.FAILED_PRECONDITION) and self._healthy:
                log.warning("shared cache tier at %s unavailable (%s); serving misses", self.address, err.code().name)
                self._healthy = False
            if raise_errors:
                raise
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
        self._direct.close()
        self._channel.close()


def _reason_for_status(code: grpc.StatusCode | None) -> MissReason:
    """A failed Fetch of one block: gone since the lookup, damaged, or the tier is down."""
    if code == grpc.StatusCode.NOT_FOUND:
        return MissReason.EVICTED
    if code == grpc.StatusCode.DATA_LOSS:
        return MissReason.FAILED_VERIFICATION
    return MissReason.SHARED_TIER_DOWN


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
