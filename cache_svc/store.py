"""CheckpointStore: block checkpoints in Redis, verified on the way in and out.

A checkpoint that carries another model's fingerprint is a miss and is deleted here; one that fails
its checksum is caught by the service while it streams (it hashes as it sends, so verification
costs no extra pass) and deleted through `discard`. A Redis that is down raises StoreUnavailable;
the service maps it to UNAVAILABLE and workers treat that as a miss.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import redis

from cache_svc import keys, memory_policy

log = logging.getLogger("hybridserve.cache.store")


class StoreUnavailable(Exception):
    """Redis did not answer."""


class StoreFull(Exception):
    """A write found no room: Redis is at maxmemory with nothing it may evict, or the model
    fingerprint already holds its bound of checkpoint bytes."""


class StoreCredentialsError(Exception):
    """Redis answered and refused our credentials (a wrong or missing password or user): retrying
    cannot help, so the service refuses to start."""


@dataclass(frozen=True, slots=True)
class WorkerAccess:
    """What a worker needs to read and write block keys directly."""

    redis_url: str  # without credentials
    username: str
    password: str
    ttl_s: int  # the lease of a block a worker writes: its key's TTL


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """How the cache service reaches and governs Redis; its flags are derived from these fields."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: str | None = None
    key_prefix: str = "hybridserve"  # every Redis key starts with it
    max_memory_bytes: int = 1 << 30  # Redis maxmemory set at start-up (0 = leave Redis's setting)
    ttl_s: int = 24 * 3600  # every block key expires this long after its last publish
    max_model_bytes: int = 512 << 20  # checkpoint bytes kept per model fingerprint (0 = no bound)
    redis_tls_ca: Path | None = None  # rediss://: trust this CA (default: the system roots)
    redis_tls_cert: Path | None = None  # rediss://: client certificate, for a Redis with tls-auth-clients
    redis_tls_key: Path | None = None  # its private key
    socket_timeout_s: float = 1.0
    worker_user: str = "hybridserve-worker"  # Redis ACL user handed to workers for the direct data path; "" = none


class CheckpointStore:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.policy_applications = 0  # times the memory policy was found missing and set
        tls: dict[str, Any] = {}
        if config.redis_url.startswith("rediss://"):
            files = {"ssl_ca_certs": config.redis_tls_ca, "ssl_certfile": config.redis_tls_cert,
                     "ssl_keyfile": config.redis_tls_key}  # fmt: skip
            tls = {name: str(path) for name, path in files.items() if path is not None}
        self.redis = redis.Redis.from_url(
            config.redis_url, password=config.redis_password, socket_timeout=config.socket_timeout_s,
            socket_connect_timeout=config.socket_timeout_s, health_check_interval=5,
            redis_connect_func=self._on_connect, **tls,
        )  # fmt: skip
        self._worker_password = secrets.token_urlsafe(24)  # the workers' Redis user, as this service sets it

    def _on_connect(self, connection: redis.connection.AbstractConnection) -> None:
        """Runs on every new connection, before its first command: authenticates (redis-py's own
        step), then puts the memory policy back if Redis lost it (a restarted Redis starts with
        maxmemory 0 and noeviction), so a restart is repaired before anything is written."""
        connection.on_connect()  # type: ignore[no-untyped-call]
        if self.config.max_memory_bytes <= 0:
            return
        replaced = memory_policy.ensure(connection, self.config.max_memory_bytes)
        if replaced is not None:
            log.log(
                logging.WARNING if self.policy_applications else logging.INFO,
                "Redis at %s had maxmemory %s and policy %s%s; set to %d bytes and %s", self.where, *replaced,
                " (restarted?)" if self.policy_applications else "", self.config.max_memory_bytes,
                memory_policy.POLICY,
            )  # fmt: skip
            self.policy_applications += 1

    def configure_memory(self) -> None:
        """Applies the memory budget and LRU eviction among our (TTL-carrying) keys (every new
        connection checks them again, see _on_connect)."""
        if self.config.max_memory_bytes <= 0:
            return
        with _redis_errors():
            self.redis.config_set("maxmemory", str(self.config.max_memory_bytes))
            self.redis.config_set("maxmemory-policy", memory_policy.POLICY)

    def check_credentials(self) -> None:
        """Raises StoreCredentialsError when Redis refuses our credentials; a Redis that does not
        answer passes (the service serves misses until it does)."""
        try:
            self.redis.ping()
        except redis.exceptions.AuthenticationError as exc:
            raise StoreCredentialsError(f"Redis at {self.where} refused the credentials: {exc}") from exc
        except redis.exceptions.ResponseError as exc:
            if "AUTH" not in str(exc).upper():
                raise
            raise StoreCredentialsError(f"Redis at {self.where} refused the credentials: {exc}") from exc
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            log.warning("Redis at %s does not answer yet (%s); serving misses until it does", self.where, exc)

    def ping(self) -> bool:
        """Whether Redis answers now (and, through _on_connect, has its memory policy)."""
        try:
            return bool(self.redis.ping())
        except redis.exceptions.RedisError:
            return False

    @property
    def where(self) -> str:
        """host:port/db of the Redis, without credentials (for messages)."""
        kwargs = self.redis.connection_pool.connection_kwargs
        if "path" in kwargs:
            return f"unix:{kwargs['path']}"
        return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"

    def lookup(self, fingerprint: str, block_hashes: list[bytes]) -> int:
        """How many leading blocks are stored (data not verified here: fetch does that)."""
        if not block_hashes:
            return 0
        with _redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for h in block_hashes:
                pipe.exists(self._key(fingerprint, h))
            found = pipe.execute()
        hits = 0
        for present in found:
            if not present:
                break
            hits += 1
        return hits

    def put(self, fingerprint: str, block_hash: bytes, parent: bytes, block_size: int, data: bytes) -> None:
        """Stores a checkpoint; StoreFull when its model already holds max_model_bytes."""
        key = self._key(fingerprint, block_hash)
        with _redis_errors():
            self._reserve(fingerprint, block_hash, len(data))
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(key, mapping={
                keys.FIELD_DATA: data,
                keys.FIELD_SHA256: hashlib.sha256(data).hexdigest(),
                keys.FIELD_FINGERPRINT: fingerprint,
                keys.FIELD_PARENT: parent.hex(),
                keys.FIELD_BLOCK_SIZE: str(block_size),
                keys.FIELD_VERSION: str(keys.SCHEMA_VERSION),
            })  # fmt: skip
            pipe.expire(key, self.config.ttl_s)
            pipe.execute()

    def get(self, fingerprint: str, block_hash: bytes) -> tuple[bytes, str] | None:
        """(data, expected sha256 hex) of a checkpoint of this model, or None (absent, or foreign
        and deleted). The caller verifies the checksum while it streams (see `discard`)."""
        key = self._key(fingerprint, block_hash)
        with _redis_errors():
            fields = self.redis.hmget(
                key, [keys.FIELD_DATA, keys.FIELD_SHA256, keys.FIELD_FINGERPRINT, keys.FIELD_VERSION]
            )
        data, digest, stored_fingerprint, version = (_as_bytes(f) for f in fields)
        if version != str(keys.SCHEMA_VERSION).encode():
            return None  # another schema version: a miss
        if data is None:
            return None
        if digest is None:
            self.discard(fingerprint, block_hash, "no checksum")
            return None
        if stored_fingerprint is None or stored_fingerprint.decode() != fingerprint:
            self.discard(fingerprint, block_hash, "fingerprint mismatch")
            return None
        return data, digest.decode()

    def discard(self, fingerprint: str, block_hash: bytes, why: str) -> bool:
        """Deletes a bad checkpoint; it is a miss from now on. True when one was there."""
        key = self._key(fingerprint, block_hash)
        log.warning("deleting checkpoint %s: %s", key, why)
        with _redis_errors():
            self._release(fingerprint, block_hash)
            return bool(self.redis.delete(key))

    # ---- the bytes kept per model ---------------------------------------------------------------
    def _reserve(self, fingerprint: str, block_hash: bytes, num_bytes: int) -> None:
        """Counts the block's bytes against its model, first making sure the model stays within
        max_model_bytes. The count can run high (Redis evicts and expires blocks behind our back), so
        a model that looks full is recounted against the blocks still there before a refusal."""
        sizes, total = self._size_keys(fingerprint)
        previous = int(self.redis.hget(sizes, block_hash.hex()) or 0)
        delta = num_bytes - previous
        limit = self.config.max_model_bytes
        looks_full = limit > 0 and int(self.redis.get(total) or 0) + delta > limit
        if looks_full and self._recount(fingerprint) + delta > limit:
            raise StoreFull(
                f"model {fingerprint[:16]} holds its bound of {limit} checkpoint bytes (--max-model-mb); "
                f"a {num_bytes}-byte block does not fit"
            )
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(sizes, block_hash.hex(), num_bytes)
        pipe.incrby(total, delta)
        pipe.expire(sizes, self.config.ttl_s)
        pipe.expire(total, self.config.ttl_s)
        pipe.execute()

    def _release(self, fingerprint: str, block_hash: bytes) -> None:
        sizes, total = self._size_keys(fingerprint)
        size = int(self.redis.hget(sizes, block_hash.hex()) or 0)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hdel(sizes, block_hash.hex())
        pipe.decrby(total, size)
        pipe.execute()

    def _recount(self, fingerprint: str) -> int:
        """Drops the sizes of blocks no longer stored; returns (and records) the model's true total."""
        sizes, total = self._size_keys(fingerprint)
        table = {_as_text(k): int(v) for k, v in self.redis.hgetall(sizes).items()}
        pipe = self.redis.pipeline(transaction=False)
        for h in table:
            pipe.exists(self._key(fingerprint, bytes.fromhex(h)))
        gone = [h for h, present in zip(table, pipe.execute(), strict=True) if not present]
        if gone:
            self.redis.hdel(sizes, *gone)
        kept = sum(v for h, v in table.items() if h not in gone)
        self.redis.set(total, kept, ex=self.config.ttl_s)
        return kept

    def model_bytes(self, fingerprint: str) -> int:
        """Checkpoint bytes counted against the model (may run high until the next recount)."""
        with _redis_errors():
            return int(self.redis.get(self._size_keys(fingerprint)[1]) or 0)

    def _size_keys(self, fingerprint: str) -> tuple[str, str]:
        return keys.sizes_key(self.config.key_prefix, fingerprint), keys.total_key(self.config.key_prefix, fingerprint)

    def grant_worker_access(self) -> WorkerAccess | None:
        """Sets up (again: Redis may have restarted) the workers' Redis ACL user, limited to the
        block keys and data commands, with this service's password added to any it has (other
        replicas' stay valid); None when there is no such user or Redis refuses (workers then go
        through the service)."""
        if not self.config.worker_user:
            return None
        rules = keys.worker_acl_rules(self.config.key_prefix, self._worker_password)
        try:
            self.redis.execute_command("ACL", "SETUSER", self.config.worker_user, *rules)  # type: ignore[no-untyped-call]
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise StoreUnavailable(f"redis unavailable: {exc}") from exc
        except redis.exceptions.ResponseError as exc:  # no ACL (Redis < 6) or no right to set users
            log.warning("cannot set up the workers' Redis user (%s); workers fetch through the service", exc)
            return None
        parsed = urlsplit(self.config.redis_url)
        netloc = f"{parsed.hostname or '127.0.0.1'}:{parsed.port or 6379}"
        url = urlunsplit((parsed.scheme, netloc, parsed.path, "", ""))  # the address, never the service's login
        return WorkerAccess(url, self.config.worker_user, self._worker_password, self.config.ttl_s)

    def used_memory_bytes(self) -> int:
        with _redis_errors():
            return int(self.redis.info("memory")["used_memory"])

    def _key(self, fingerprint: str, block_hash: bytes) -> str:
        return keys.block_key(self.config.key_prefix, fingerprint, block_hash)

    def close(self) -> None:
        self.redis.close()


def _as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _as_bytes(value: bytes | str | None) -> bytes | None:
    """A Redis reply field as bytes (the client is not set to decode, so it already is)."""
    return value.encode() if isinstance(value, str) else value


class _redis_errors:
    """Turns connection-level Redis failures into StoreUnavailable."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> Literal[False]:
        if exc is None:
            return False
        if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
            raise StoreUnavailable(f"redis unavailable: {exc}") from exc
        if isinstance(exc, redis.exceptions.OutOfMemoryError):
            raise StoreFull(
                f"Redis is at its maxmemory and has nothing it may evict ({exc}); the checkpoint was not"
                " stored (raise --max-memory-mb, or publish smaller blocks)"
            ) from exc
        if isinstance(exc, redis.exceptions.ResponseError):  # READONLY, NOPERM, ...: Redis refused the command
            raise StoreUnavailable(f"redis refused the command: {exc}") from exc
        return False
