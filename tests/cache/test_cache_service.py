"""BlockCache against a real Redis: lookup, publish, streamed fetch, integrity, memory budget."""

from __future__ import annotations

import hashlib
import os

import grpc
import pytest

from cache_svc import keys
from cache_svc.server import create_server
from cache_svc.store import StoreConfig
from hybridserve.v1 import cache_pb2 as pb
from hybridserve.v1 import cache_pb2_grpc

FP = "f" * 64


def publish(stub, block_hash: bytes, data: bytes, parent: bytes = b"", fingerprint: str = FP) -> None:
    stub.Publish(
        pb.PublishRequest(model_fingerprint=fingerprint, block_hash=block_hash, parent_hash=parent, block_size=16,
                          checkpoint=data, checksum=hashlib.sha256(data).digest()),
        timeout=10,
    )  # fmt: skip


def fetch(stub, block_hash: bytes, fingerprint: str = FP) -> bytes:
    return b"".join(
        c.data for c in stub.Fetch(pb.FetchRequest(model_fingerprint=fingerprint, block_hash=block_hash), timeout=10)
    )


def test_lookup_counts_leading_blocks_and_fetch_streams_large_checkpoints(cache_service):
    stub = cache_service.stub
    blobs = [os.urandom(3 * 1024 * 1024 + i) for i in range(3)]  # > one 1 MiB chunk each
    hashes = [bytes([i]) * 32 for i in range(4)]
    for h, blob in zip(hashes, blobs, strict=False):
        publish(stub, h, blob)
    lookup = stub.Lookup(pb.LookupRequest(model_fingerprint=FP, block_hashes=hashes), timeout=10)
    assert lookup.num_hit_blocks == 3
    gap = [hashes[0], hashes[3], hashes[1]]
    assert stub.Lookup(pb.LookupRequest(model_fingerprint=FP, block_hashes=gap), timeout=10).num_hit_blocks == 1
    chunks = list(stub.Fetch(pb.FetchRequest(model_fingerprint=FP, block_hash=hashes[1]), timeout=10))
    assert [c.WhichOneof("part") for c in chunks] == ["header", "data", "data"]
    assert chunks[0].header.total_bytes == len(blobs[1])
    assert b"".join(c.data for c in chunks) == blobs[1]
    assert chunks[0].header.checksum == hashlib.sha256(blobs[1]).digest()
    other = stub.Lookup(pb.LookupRequest(model_fingerprint="0" * 64, block_hashes=hashes), timeout=10)
    assert other.num_hit_blocks == 0


def test_corrupted_or_foreign_checkpoints_are_misses_and_deleted(cache_service, redis_server):
    stub, client = cache_service.stub, redis_server.client()
    publish(stub, b"a" * 32, b"good checkpoint bytes")
    publish(stub, b"b" * 32, b"another checkpoint")
    key_a = keys.block_key("hybridserve", FP, b"a" * 32)
    data = bytearray(client.hget(key_a, keys.FIELD_DATA))
    data[3] ^= 0xFF  # flip bytes at rest
    client.hset(key_a, keys.FIELD_DATA, bytes(data))
    key_b = keys.block_key("hybridserve", FP, b"b" * 32)
    client.hset(key_b, keys.FIELD_FINGERPRINT, "e" * 64)
    for block_hash, key, code in (
        (b"a" * 32, key_a, grpc.StatusCode.DATA_LOSS),  # detected while streaming
        (b"b" * 32, key_b, grpc.StatusCode.NOT_FOUND),
    ):
        with pytest.raises(grpc.RpcError) as err:
            fetch(stub, block_hash)
        assert err.value.code() == code
        assert not client.exists(key), "a bad checkpoint is deleted"
        with pytest.raises(grpc.RpcError) as err:
            fetch(stub, block_hash)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_publish_with_a_wrong_checksum_is_rejected(cache_service):
    with pytest.raises(grpc.RpcError) as err:
        cache_service.stub.Publish(
            pb.PublishRequest(
                model_fingerprint=FP, block_hash=b"c" * 32, block_size=16, checkpoint=b"x", checksum=b"y"
            ),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_redis_down_is_unavailable_then_recovers(redis_server):
    from cache_svc.embedded_redis import RedisProcess

    port = redis_server.port
    server, bound, _, store = create_server(StoreConfig(redis_url=redis_server.url, max_memory_bytes=0))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{bound}") as channel:
            stub = cache_pb2_grpc.BlockCacheStub(channel)
            publish(stub, b"d" * 32, b"before the crash")
            redis_server.kill()
            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(pb.LookupRequest(model_fingerprint=FP, block_hashes=[b"d" * 32]), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            restarted = RedisProcess(port=port)
            try:
                publish(stub, b"d" * 32, b"after the restart")
                assert fetch(stub, b"d" * 32) == b"after the restart"
            finally:
                restarted.stop()
    finally:
        server.stop(None)
        store.close()


@pytest.mark.slow
def test_memory_budget_holds_under_a_flood_of_distinct_prefixes(redis_server):
    budget = 8 << 20
    server, bound, _, store = create_server(StoreConfig(redis_url=redis_server.url, max_memory_bytes=budget))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{bound}") as channel:
            stub = cache_pb2_grpc.BlockCacheStub(channel)
            blob = os.urandom(256 * 1024)
            peak = 0
            for i in range(200):  # 50 MiB published into an 8 MiB budget
                publish(stub, i.to_bytes(32, "little"), blob)
                peak = max(peak, store.used_memory_bytes())
            assert peak <= budget * 1.1, f"Redis used {peak} bytes with a {budget} byte budget"
            recent = [i.to_bytes(32, "little") for i in range(195, 200)]
            hits = stub.Lookup(pb.LookupRequest(model_fingerprint=FP, block_hashes=recent), timeout=10)
            assert hits.num_hit_blocks == 5, "the most recent blocks survive (LRU)"
    finally:
        server.stop(None)
        store.close()
