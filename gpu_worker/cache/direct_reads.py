"""The worker's direct read path to the shared tier: checkpoint bytes read from Redis itself under
the user and keys the cache service hands out (`BlockCache.Access`, cache_svc/client.py), in
pipelined batches for a run of blocks, each batch verified on another thread while the next is read.

The path is asked of the service once, and again after a failed ask or read (Redis may have
restarted and forgotten the workers' user); after MAX_DIRECT_FAILURES failed reads in a row (e.g.
Redis unreachable from this worker) the worker reads through the service only."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from cache_svc.client import DataPathError, DirectBlocks, StoredBlock
from gpu_worker.cache.misses import MissReason
from gpu_worker.runner.checkpoint_io import BlockCheckpoint
from hybridserve.v1 import cache_pb2 as pb

log = logging.getLogger("hybridserve.cache.client")
T = TypeVar("T")
PIPELINE_BYTES = 4 << 20  # a direct fetch reads blocks in pipelined batches of about this many bytes
MAX_DIRECT_FAILURES = 3  # direct reads failing in a row before a worker reads through the service only


@dataclass(frozen=True, slots=True)
class FetchedBlock:
    block_hash: bytes
    parent_hash: bytes
    checkpoint: BlockCheckpoint


Verified = tuple[list[FetchedBlock], MissReason | None, int]  # blocks, why it stopped, bytes read
VerifyRows = Callable[[list[bytes], range, list[StoredBlock | None]], Verified]


class DirectReads:
    """The direct read path of one worker. `ask_access` asks the service for it: (the grant, None)
    or (None, the call's status code)."""

    def __init__(
        self,
        ask_access: Callable[[], tuple[pb.AccessResponse | None, grpc.StatusCode | None]],
        verify_rows: VerifyRows,
        socket_timeout_s: float,
    ) -> None:
        self._ask_access = ask_access
        self._verify_rows = verify_rows
        self._socket_timeout_s = socket_timeout_s
        self._verify_pool = ThreadPoolExecutor(2, thread_name_prefix="cache-verify")  # overlaps the next read
        self._direct: DirectBlocks | None = None  # once the service granted it
        self._refused = False  # the service hands out none: Fetch through it
        self._lock = threading.Lock()
        self._failures = 0  # direct reads failed in a row

    @property
    def active(self) -> bool:
        """Whether checkpoint bytes currently come directly from Redis."""
        return self._direct is not None

    def path(self) -> DirectBlocks | None:
        """The direct read path, asked of the service once (again after a failed ask or read)."""
        if self._direct is not None or self._refused:
            return self._direct
        with self._lock:
            if self._direct is None and not self._refused:
                access, code = self._ask_access()
                if access is not None:
                    try:
                        self._direct = DirectBlocks(access, socket_timeout_s=self._socket_timeout_s)
                    except DataPathError as exc:
                        log.warning("not using the direct data path: %s", exc)
                        self._refused = True
                elif code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                    self._refused = True
        return self._direct

    def _drop(self, direct: DirectBlocks) -> None:
        """A failed direct read: ask the service again next time, or give up after
        MAX_DIRECT_FAILURES in a row."""
        with self._lock:
            if self._direct is direct:
                self._direct = None
            self._failures += 1
            if self._failures >= MAX_DIRECT_FAILURES and not self._refused:
                log.warning(
                    "the direct data path failed %d times in a row; reading through the service", MAX_DIRECT_FAILURES
                )
                self._refused = True
        direct.close()

    def read(
        self, direct: DirectBlocks, block_hashes: list[bytes], first: int, end: int, block_bytes_hint: int
    ) -> Verified | None:
        """Blocks [first, end) read in pipelined batches of about PIPELINE_BYTES (one round trip
        each), each batch verified on another thread while the next is read; stops at the first
        bad block. None when Redis cannot be read directly before any block came (the caller reads
        through the service)."""
        per_batch = max(1, PIPELINE_BYTES // block_bytes_hint) if block_bytes_hint > 0 else end - first
        checks: list[Future[Verified]] = []
        for start in range(first, end, per_batch):
            if any(c.done() and c.result()[1] is not None for c in checks):
                break  # a bad block: what follows cannot be part of the hit
            indices = range(start, min(start + per_batch, end))
            try:
                rows = direct.read([block_hashes[i] for i in indices], max_block_bytes(block_bytes_hint))
            except DataPathError as exc:
                log.warning("direct read failed: %s", exc)
                self._drop(direct)
                if not checks:
                    return None
                checks.append(_done(([], MissReason.SHARED_TIER_DOWN, 0)))
                break
            self._failures = 0
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

    def close(self) -> None:
        self._verify_pool.shutdown(wait=False, cancel_futures=True)
        if self._direct is not None:
            self._direct.close()


def max_block_bytes(block_bytes: int) -> int:
    """The most bytes a fetch reads for one block of `block_bytes` expected (twice that, plus room
    for the format's header); 0 (no bound) when the size is not known."""
    return 2 * block_bytes + (64 << 10) if block_bytes > 0 else 0


def _done(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future
