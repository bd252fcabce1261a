"""The client side of the cache service's direct data path: a worker reads block checkpoints from
Redis itself, under the keys and user that `BlockCache.Access` hands out, one pipelined round trip
for a run of blocks. The service keeps the schema (cache_svc/keys.py), the policy (memory budget,
TTL, bytes per model), the lookups and every write (Publish); the worker verifies what it reads
(schema version, model fingerprint, the checkpoint's MAC) and asks the service to delete what fails."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import Pipeline

from cache_svc import keys
from hybridserve.v1 import cache_pb2 as pb

SOCKET_READ_BYTES = 1 << 20  # checkpoints are MBs: fewer, larger reads than redis-py's 64 KiB default


class DataPathError(Exception):
    """Redis did not answer or refused the worker's user."""


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One block as Redis holds it (not verified yet)."""

    data: bytes
    checksum: bytes  # the stored SHA-256 of data (32 bytes; empty when absent or malformed)
    fingerprint: str
    version: int  # the schema version that wrote it (0 when absent)
    oversized: bool = False  # larger than the reader's bound: not read (data empty)

    @property
    def is_current_schema(self) -> bool:
        return self.version == keys.SCHEMA_VERSION


class DirectBlocks:
    """Block keys of one model, read directly. Thread-safe (redis-py's pool)."""

    def __init__(self, access: pb.AccessResponse, socket_timeout_s: float = 5.0) -> None:
        if access.schema_version != keys.SCHEMA_VERSION:
            raise DataPathError(
                f"the cache service speaks key schema {access.schema_version}, not {keys.SCHEMA_VERSION}"
            )
        self.key_prefix = access.key_prefix
        self.ttl_s = int(access.ttl_s)
        self.redis = redis.Redis.from_url(
            access.redis_url, username=access.username, password=access.password,
            socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            socket_read_size=SOCKET_READ_BYTES,
        )  # fmt: skip

    def read(self, block_hashes: list[bytes], max_bytes: int = 0) -> list[StoredBlock | None]:
        """The stored blocks, in order (None where absent), in one round trip; with max_bytes > 0
        the sizes are asked first (one more round trip) and a block larger than that ends the run
        as an `oversized` row, its bytes never read."""
        if max_bytes > 0:
            sizes = self._call(lambda pipe, key: pipe.hstrlen(key, keys.FIELD_DATA), block_hashes)
            too_big = next((i for i, size in enumerate(sizes) if int(size) > max_bytes), None)
            if too_big is not None:
                return [*self.read(block_hashes[:too_big]), StoredBlock(b"", b"", "", 0, oversized=True)]
        fields = [keys.FIELD_DATA, keys.FIELD_SHA256, keys.FIELD_FINGERPRINT, keys.FIELD_VERSION]
        rows = self._call(lambda pipe, key: pipe.hmget(key, fields), block_hashes)
        return [_stored(row) for row in rows]

    def _call(self, command: Callable[[Pipeline, str], object], block_hashes: list[bytes]) -> list[Any]:
        """One command per block key, pipelined in one round trip."""
        if not block_hashes:
            return []
        try:
            pipe = self.redis.pipeline(transaction=False)
            for block_hash in block_hashes:
                command(pipe, self.key_prefix + block_hash.hex())
            return pipe.execute()
        except redis.RedisError as exc:
            raise DataPathError(f"direct read failed: {exc}") from exc

    def close(self) -> None:
        self.redis.close()


def _stored(row: list[bytes | None]) -> StoredBlock | None:
    data, digest, fingerprint, version = row
    if data is None:
        return None
    try:
        checksum = bytes.fromhex(digest.decode()) if digest else b""
        number = int(version) if version else 0
    except ValueError:
        checksum, number = b"", 0
    return StoredBlock(data, checksum, fingerprint.decode(errors="replace") if fingerprint else "", number)
