"""The worker's client of the shared tier (cache_svc). Publishing happens on a background thread,
off the step's critical path; lookups and fetches run on a small pool so the engine never waits on
the network. Lookups go to the service; checkpoint bytes move directly between the worker and
Redis when the service grants access (cache_svc/client.py: one pipelined round trip per run of
blocks, verified here), else through the service's Publish and Fetch. Every failure (cache_svc or
Redis down, a damaged checkpoint) is a miss, logged once per outage; the gRPC channel reconnects
by itself when the service returns, and the direct path is asked for again after it failed."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import grpc
from opentelemetry import context as otel_context

from cache_svc.client import BlockWrite, DataPathError, DirectBlocks, StoredBlock
from gpu_worker.cache.checkpoint_io import BlockCheckpoint, from_bytes, to_bytes
from gpu_worker.cache.misses import FetchOrRecompute, MissReason, reason_for_checkpoint_error
from hybridserve import telemetry
from hybridserve.errors import InvalidArgumentError
from hybridserve.v1 import cache_pb2 as pb
from hybridserve.v1 import cache_pb2_grpc as pb_grpc

log = logging.getLogger("hybridserve.cache.client")
T = TypeVar("T")


PUBLISH_BATCH_BLOCKS = 32  # most blocks one pipelined publish carries
PIPELINE_BYTES = 4 << 20  # a fetch reads blocks in pipelined batches of about this many bytes
_BLOCK_ERRORS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS)  # about one block, not the tier


@dataclass(frozen=True, slots=True)
class FetchedBlock:
    block_hash: bytes
    parent_hash: bytes
    checkpoint: BlockCheckpoint


@dataclass(frozen=True, slots=True)
class FetchResult:
    """What the shared tier gave for one request's prefix."""

    request_id: str
    blocks: list[FetchedBlock]  # verified, in order, the last with state (empty: none)
    miss_reason: MissReason | None  # why it gave no more (None: it held nothing more)
    decision: str  # "fetch" or "recompute" (fetch-or-recompute), "" when it held nothing to offer
    num_offered_blocks: int  # blocks it held beyond the local hit


def max_block_bytes(block_bytes: int) -> int:
    """The most bytes a fetch reads for one block of `block_bytes` expected (twice that, plus room
    for the format's header); 0 (no bound) when the size is not known."""
    return 2 * block_bytes + (64 << 10) if block_bytes > 0 else 0


def _done(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future


def _reason_for_status(code: grpc.StatusCode | None) -> MissReason:
    """A failed Fetch of one block: gone since the lookup, damaged, or the tier is down."""
    if code == grpc.StatusCode.NOT_FOUND:
        return MissReason.EVICTED
    if code == grpc.StatusCode.DATA_LOSS:
        return MissReason.FAILED_VERIFICATION
    return MissReason.SHARED_TIER_DOWN


class SharedTier:
    def __init__(
        self, address: str, fingerprint: str, block_size: int, deadline_s: float = 1.0, max_pending: int = 256
    ) -> None:
        self.address = address
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.deadline_s = deadline_s
        self._channel = grpc.insecure_channel(address)
        channel = telemetry.intercept_channel(self._channel)  # carries the trace context
        self._stub = pb_grpc.BlockCacheStub(channel)  # type: ignore[no-untyped-call]
        self._publish_queue: queue.Queue[tuple[bytes, bytes, BlockCheckpoint] | None] = queue.Queue(max_pending)
        self._fetch_pool = ThreadPoolExecutor(2, thread_name_prefix="cache-fetch")
        self._verify_pool = ThreadPoolExecutor(2, thread_name_prefix="cache-verify")  # overlaps the next read
        self._publisher = threading.Thread(target=self._publish_loop, name="cache-publish", daemon=True)
        self._publisher.start()
        self._healthy = True
        self.num_published = 0
        self._direct: DirectBlocks | None = None  # the direct data path, once the service granted it
        self._direct_refused = False  # the service hands out none: Publish and Fetch through it
        self._direct_lock = threading.Lock()

    # ---- publish (engine thread enqueues, the publisher sends) ------------------------------------
    def publish(self, block_hash: bytes, parent_hash: bytes, checkpoint: BlockCheckpoint) -> None:
        try:
            self._publish_queue.put_nowait((block_hash, parent_hash, checkpoint))
        except queue.Full:
            log.debug("publish queue full; dropping block %s", block_hash.hex()[:12])

    def _publish_loop(self) -> None:
        """Sends what is queued, a run of blocks at a time (one pipelined write on the direct path)."""
        while True:
            batch = [self._publish_queue.get()]
            while batch[-1] is not None and len(batch) < PUBLISH_BATCH_BLOCKS:
                try:
                    batch.append(self._publish_queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._publish_batch([item for item in batch if item is not None])
            finally:
                for _ in batch:
                    self._publish_queue.task_done()
            if batch[-1] is None:
                return

    def _publish_batch(self, items: list[tuple[bytes, bytes, BlockCheckpoint]]) -> None:
        if not items:
            return
        encoded = [(h, parent, *to_bytes(c, self.fingerprint, self.block_size)) for h, parent, c in items]
        direct = self._direct_path()
        if direct is not None:
            try:
                direct.write([BlockWrite(*e) for e in encoded], self.fingerprint, self.block_size)
                self.num_published += len(encoded)
            except DataPathError as exc:
                log.warning("direct publish of %d blocks failed: %s", len(encoded), exc)
                self._drop_direct(direct)
            return
        for block_hash, parent_hash, data, checksum in encoded:
            request = pb.PublishRequest(
                model_fingerprint=self.fingerprint, block_hash=block_hash, parent_hash=parent_hash,
                block_size=self.block_size, checkpoint=data, checksum=checksum,
            )  # fmt: skip
            if self._call(partial(self._stub.Publish, request, timeout=self.deadline_s * 5)) is not None:
                self.num_published += 1

    @property
    def uses_direct_path(self) -> bool:
        """Whether checkpoint bytes currently move directly between this worker and Redis."""
        return self._direct is not None

    def _direct_path(self) -> DirectBlocks | None:
        """The direct data path, asked of the service once (again after a failed ask)."""
        if self._direct is not None or self._direct_refused:
            return self._direct
        with self._direct_lock:
            if self._direct is None and not self._direct_refused:
                request = pb.AccessRequest(model_fingerprint=self.fingerprint)
                access, code = self._try(lambda: self._stub.Access(request, timeout=self.deadline_s))
                if access is not None:
                    try:
                        self._direct = DirectBlocks(access, socket_timeout_s=self.deadline_s * 5)
                    except DataPathError as exc:
                        log.warning("not using the direct data path: %s", exc)
                        self._direct_refused = True
                elif code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                    self._direct_refused = True
        return self._direct

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
        offered = found.num_hit_blocks - num_local_blocks
        if offered <= 0:
            return FetchResult(request_id, [], None, "", 0)
        decision = policy.decide(offered) if policy is not None else None
        if decision is not None and not decision.fetch:
            return FetchResult(request_id, [], MissReason.FETCH_SLOWER, "recompute", offered)
        started = time.monotonic()
        direct = self._direct_path()
        if direct is not None:
            hint = policy.bytes_per_block if policy is not None else 0
            fetched, reason, num_bytes = self._read_direct(
                direct, block_hashes, num_local_blocks, found.num_hit_blocks, hint
            )
        else:
            fetched, reason, num_bytes = self._read_via_service(block_hashes, num_local_blocks, found.num_hit_blocks)
        if policy is not None:
            policy.record_fetch(num_bytes, time.monotonic() - started)
        while fetched and not fetched[-1].checkpoint.has_state:
            fetched.pop()  # a hit must end on the state at its boundary: KV alone is a miss
            reason = reason or MissReason.KV_WITHOUT_STATE
        return FetchResult(request_id, fetched, reason, "fetch", offered)

    def _drop_direct(self, direct: DirectBlocks) -> None:
        """A failed direct call: ask the service again next time (Redis may have restarted and
        forgotten the workers' user)."""
        with self._direct_lock:
            if self._direct is direct:
                self._direct = None
        direct.close()

    def _read_direct(
        self, direct: DirectBlocks, block_hashes: list[bytes], first: int, end: int, block_bytes_hint: int
    ) -> tuple[list[FetchedBlock], MissReason | None, int]:
        """Blocks [first, end) read in pipelined batches of about PIPELINE_BYTES (one round trip
        each), each batch verified on another thread while the next is read; stops at the first
        bad block."""
        per_batch = max(1, PIPELINE_BYTES // block_bytes_hint) if block_bytes_hint > 0 else end - first
        checks: list[Future[tuple[list[FetchedBlock], MissReason | None, int]]] = []
        for start in range(first, end, per_batch):
            if any(c.done() and c.result()[1] is not None for c in checks):
                break  # a bad block: what follows cannot be part of the hit
            indices = range(start, min(start + per_batch, end))
            try:
                rows = direct.read([block_hashes[i] for i in indices], max_block_bytes(block_bytes_hint))
            except DataPathError as exc:
                log.warning("direct read failed: %s", exc)
                self._drop_direct(direct)
                checks.append(_done(([], MissReason.SHARED_TIER_DOWN, 0)))
                break
            checks.append(self._verify_pool.submit(self._verify_rows, block_hashes, indices, rows))
        fetched: list[FetchedBlock] = []
        num_bytes = 0
        for check in checks:
            blocks, reason, size = check.result()
            fetched += blocks
            num_bytes += size
            if reason is not None:
                return fetched, reason, num_bytes
        return fetched, None, num_bytes

    def _verify_rows(
        self, block_hashes: list[bytes], indices: range, rows: list[StoredBlock | None]
    ) -> tuple[list[FetchedBlock], MissReason | None, int]:
        """Checks the rows read for `indices`: present, this model and schema, intact."""
        fetched: list[FetchedBlock] = []
        num_bytes = 0
        for index, row in zip(indices, rows, strict=True):
            if row is None:
                return fetched, MissReason.EVICTED, num_bytes  # gone since the lookup
            if row.oversized:
                log.warning(
                    "block %s is larger than this model's checkpoints; not read", block_hashes[index].hex()[:12]
                )
                return fetched, MissReason.FAILED_VERIFICATION, num_bytes
            if not row.is_current_schema or row.fingerprint != self.fingerprint:
                return fetched, MissReason.FOREIGN_FINGERPRINT, num_bytes
            try:
                checkpoint = from_bytes(row.data, row.checksum, self.fingerprint, self.block_size)
            except InvalidArgumentError as exc:
                log.warning("discarding fetched block %s: %s", block_hashes[index].hex()[:12], exc)
                return fetched, reason_for_checkpoint_error(exc), num_bytes
            num_bytes += len(row.data)
            fetched.append(FetchedBlock(block_hashes[index], block_hashes[index - 1] if index else b"", checkpoint))
        return fetched, None, num_bytes

    def _read_via_service(
        self, block_hashes: list[bytes], first: int, end: int
    ) -> tuple[list[FetchedBlock], MissReason | None, int]:
        """Blocks [first, end) streamed by the service one by one; stops at the first bad one."""
        fetched: list[FetchedBlock] = []
        num_bytes = 0
        for index in range(first, end):
            checkpoint, size, reason = self._fetch_one(block_hashes[index])
            if checkpoint is None:
                return fetched, reason, num_bytes
            num_bytes += size
            fetched.append(FetchedBlock(block_hashes[index], block_hashes[index - 1] if index else b"", checkpoint))
        return fetched, None, num_bytes

    def _fetch_one(self, block_hash: bytes) -> tuple[BlockCheckpoint | None, int, MissReason | None]:
        """(checkpoint, its size in bytes, None) or (None, 0, why not)."""
        request = pb.FetchRequest(model_fingerprint=self.fingerprint, block_hash=block_hash)

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
        try:
            return from_bytes(got[0], got[1], self.fingerprint, self.block_size), len(got[0]), None
        except InvalidArgumentError as exc:
            log.warning("discarding fetched block %s: %s", block_hash.hex()[:12], exc)
            return None, 0, reason_for_checkpoint_error(exc)

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
            if err.code() not in _BLOCK_ERRORS and self._healthy:
                log.warning("shared cache tier at %s unavailable (%s); serving misses", self.address, err.code().name)
                self._healthy = False
            if raise_errors:
                raise
            return None
        if not self._healthy:
            log.info("shared cache tier at %s is back", self.address)
            self._healthy = True
        return result

    def close(self) -> None:
        self._publish_queue.put(None)
        self._publisher.join(5)
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        self._verify_pool.shutdown(wait=False, cancel_futures=True)
        self._channel.close()
        if self._direct is not None:
            self._direct.close()
