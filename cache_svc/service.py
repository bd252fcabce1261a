"""The BlockCache gRPC servicer: converts in, calls the store, converts out."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Literal

import grpc

from cache_svc import keys
from cache_svc.store import CheckpointStore, StoreFull, StoreUnavailable
from hybridserve import grpc_server
from hybridserve.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError, UnavailableError
from hybridserve.v1 import cache_pb2 as pb

FETCH_CHUNK_BYTES = 2 << 20  # under gRPC's default 4 MiB message limit
MAX_LOOKUP_BLOCKS = 65536


class BlockCacheServicer:
    def __init__(self, store: CheckpointStore, max_publish_bytes: int = 64 << 20) -> None:
        self.store = store
        self.max_publish_bytes = max_publish_bytes  # one checkpoint's bytes at most (0 = no bound)

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        _require_fingerprint(request.model_fingerprint)
        if len(request.block_hashes) > MAX_LOOKUP_BLOCKS:
            raise InvalidArgumentError(f"at most {MAX_LOOKUP_BLOCKS} block hashes per lookup")
        with _unavailable():
            hits = self.store.lookup(request.model_fingerprint, list(request.block_hashes))
        return pb.LookupResponse(num_hit_blocks=hits)

    def Publish(self, request: pb.PublishRequest, context: grpc.ServicerContext) -> pb.PublishResponse:
        _require_fingerprint(request.model_fingerprint)
        if not request.block_hash or request.block_size <= 0 or not request.checkpoint:
            raise InvalidArgumentError("publish needs block_hash, a positive block_size and checkpoint bytes")
        if 0 < self.max_publish_bytes < len(request.checkpoint):
            raise ResourceExhaustedError(
                f"checkpoint of {len(request.checkpoint)} bytes is over this service's bound of "
                f"{self.max_publish_bytes} (--max-publish-mb)"
            )
        if hashlib.sha256(request.checkpoint).digest() != request.checksum:
            raise InvalidArgumentError("checksum is not the SHA-256 of checkpoint; the bytes were damaged in transit")
        with _unavailable():
            self.store.put(
                request.model_fingerprint, request.block_hash, request.parent_hash, request.block_size,
                request.checkpoint,
            )  # fmt: skip
        return pb.PublishResponse(stored=True)

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[pb.FetchChunk]:
        """Streams the header, then the checkpoint in pieces, hashing as it goes; a checksum mismatch
        ends the stream with DATA_LOSS (the client discards what it got) and deletes the checkpoint."""
        _require_fingerprint(request.model_fingerprint)
        with _unavailable():
            found = self.store.get(request.model_fingerprint, request.block_hash)
        if found is None:
            raise NotFoundError(f"no checkpoint for block {request.block_hash.hex()}")
        data, digest_hex = found
        yield pb.FetchChunk(header=pb.FetchHeader(total_bytes=len(data), checksum=bytes.fromhex(digest_hex)))
        view = memoryview(data)
        digest = hashlib.sha256()
        for offset in range(0, len(data), FETCH_CHUNK_BYTES):
            piece = view[offset : offset + FETCH_CHUNK_BYTES]
            digest.update(piece)
            yield pb.FetchChunk(data=bytes(piece))
        if digest.hexdigest() != digest_hex:
            with _unavailable():
                self.store.discard(request.model_fingerprint, request.block_hash, "checksum mismatch")
            context.abort(grpc.StatusCode.DATA_LOSS, f"checkpoint {request.block_hash.hex()} failed its checksum")

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        """A worker refused this checkpoint (or an operator wants it gone): it is a miss from now on."""
        _require_fingerprint(request.model_fingerprint)
        if not request.block_hash:
            raise InvalidArgumentError("delete needs block_hash")
        why = "".join(c if c.isprintable() else "?" for c in request.reason[:80]) or "deleted by a client"
        with _unavailable():
            deleted = self.store.discard(request.model_fingerprint, request.block_hash, why)
        return pb.DeleteResponse(deleted=deleted)

    def Access(self, request: pb.AccessRequest, context: grpc.ServicerContext) -> pb.AccessResponse:
        """The direct data path's address, user and lease (the user is set up on every ask: a
        restarted Redis has forgotten it)."""
        _require_fingerprint(request.model_fingerprint)
        with _unavailable():
            access = self.store.grant_worker_access()
        if access is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this cache service hands out no direct Redis access (--worker-user ''); use Publish and Fetch",
            )
        assert access is not None  # abort raised
        return pb.AccessResponse(
            redis_url=access.redis_url, username=access.username, password=access.password,
            key_prefix=keys.block_key_prefix(self.store.config.key_prefix, request.model_fingerprint),
            ttl_s=access.ttl_s, schema_version=keys.SCHEMA_VERSION,
        )  # fmt: skip


def _require_fingerprint(fingerprint: str) -> None:
    if not fingerprint:
        raise InvalidArgumentError("model_fingerprint is required")


class _unavailable:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> Literal[False]:
        if isinstance(exc, StoreUnavailable):
            raise UnavailableError(str(exc)) from exc
        if isinstance(exc, StoreFull):
            raise ResourceExhaustedError(str(exc)) from exc
        return False


def add_to_server(servicer: BlockCacheServicer) -> grpc_server.Adder:
    def add(server: grpc.Server) -> str:
        return grpc_server.add_servicer(server, pb.DESCRIPTOR.services_by_name["BlockCache"], servicer)

    return add
