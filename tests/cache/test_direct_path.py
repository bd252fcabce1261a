"""The shared tier's direct data path: workers read and write block keys in Redis themselves, as an
ACL user the cache service sets up (block keys and data commands only); entries of another schema
version are misses; without the direct path, Publish and Fetch through the service still work."""

from __future__ import annotations

import hashlib

import grpc
import pytest
import redis

from cache_svc import keys
from cache_svc.server import create_server
from cache_svc.store import StoreConfig
from hybridserve.grpc_auth import with_bearer
from hybridserve.v1 import cache_pb2 as pb
from hybridserve.v1 import cache_pb2_grpc
from tests.cache.served import serve
from tests.cache.test_miss_reasons import BLOCK, CONFIG, tokens
from tests.worker.conftest import SHARED_ACCESS

__all__ = ["serve"]


def test_the_workers_redis_user_reads_block_keys_and_nothing_else(cache_service):
    fingerprint = "f" * 64
    data = b"a sealed checkpoint's bytes"
    cache_service.stub.Publish(pb.PublishRequest(
        model_fingerprint=fingerprint, block_hash=b"\xab" * 32, block_size=16, checkpoint=data,
        checksum=hashlib.sha256(data).digest()), timeout=10)  # fmt: skip
    access = cache_service.stub.Access(pb.AccessRequest(model_fingerprint=fingerprint), timeout=10)
    assert access.schema_version == keys.SCHEMA_VERSION
    assert access.key_prefix == keys.block_key_prefix("hybridserve", fingerprint)
    assert "@" not in access.redis_url, "the URL carries no credentials"
    worker = redis.Redis.from_url(access.redis_url, username=access.username, password=access.password)
    key = access.key_prefix + "ab" * 32
    assert worker.hmget(key, [keys.FIELD_DATA]) == [data]
    assert worker.hstrlen(key, keys.FIELD_DATA) == len(data)
    for forbidden in (
        lambda: worker.hset(key, mapping={"data": b"x"}),  # writes go through Publish and its bounds
        lambda: worker.expire(key, 1),
        lambda: worker.delete(key),
        lambda: worker.config_get("maxmemory"),
        lambda: worker.flushall(),
        lambda: worker.keys("*"),
        lambda: worker.set("not-a-block-key", b"x"),
        lambda: worker.get(keys.sizes_key("hybridserve", fingerprint)),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
    worker.close()


def test_a_second_worker_hits_through_the_direct_path(serve, checkpoint, cache_service, redis_server):
    first = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=cache_service.address)
    prompt = tokens(3 * BLOCK + 5, 1)
    first.run(prompt)
    shared = first.engine.prefix.shared
    assert shared.flush() and shared.num_published >= 3
    assert not shared.uses_direct_path, "writes go through Publish"
    stored = list(redis_server.client().scan_iter(keys.block_key_pattern("hybridserve")))
    assert len(stored) >= 3
    second = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=cache_service.address)
    assert second.run(prompt[: 3 * BLOCK] + tokens(4, 2))[2] == 3 * BLOCK
    assert second.engine.prefix.shared.uses_direct_path


def test_entries_of_another_schema_version_are_misses(serve, checkpoint, cache_service, redis_server):
    first = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=cache_service.address)
    prompt = tokens(3 * BLOCK + 5, 3)
    first.run(prompt)
    assert first.engine.prefix.shared.flush()
    client = redis_server.client()
    for key in client.scan_iter(keys.block_key_pattern("hybridserve")):
        client.hset(key, keys.FIELD_VERSION, str(keys.SCHEMA_VERSION - 1))
    second = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=cache_service.address)
    assert second.run(prompt[: 3 * BLOCK] + tokens(4, 4))[2] == 0
    assert dict(second.info().prefix_cache_miss_reasons) == {"foreign_fingerprint": 1}


def test_without_direct_access_blocks_go_through_the_service(serve, checkpoint, redis_server):
    token = SHARED_ACCESS.cluster_token
    assert token is not None
    server, port, _, store = create_server(
        StoreConfig(redis_url=redis_server.url, worker_user=""), tokens=frozenset({token})
    )
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        stub_channel = with_bearer(grpc.insecure_channel(address), token)
        with pytest.raises(grpc.RpcError) as refused:
            cache_pb2_grpc.BlockCacheStub(stub_channel).Access(pb.AccessRequest(model_fingerprint="f" * 64), timeout=5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        stub_channel.close()
        first = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=address)
        prompt = tokens(2 * BLOCK + 5, 5)
        first.run(prompt)
        assert first.engine.prefix.shared.flush()
        assert not first.engine.prefix.shared.uses_direct_path
        second = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=address)
        assert second.run(prompt[: 2 * BLOCK] + tokens(3, 6))[2] == 2 * BLOCK
    finally:
        server.stop(None)
        store.close()


def test_a_block_far_larger_than_this_models_checkpoints_is_not_read(
    serve, checkpoint, cache_service, redis_server, caplog
):
    first = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=cache_service.address)
    prompt = tokens(2 * BLOCK + 5, 7)
    first.run(prompt)
    assert first.engine.prefix.shared.flush()
    client = redis_server.client()
    huge = b"\0" * (8 << 20)  # a hostile writer's 8 MiB under a block key (this model's blocks are KiBs)
    for key in client.scan_iter(keys.block_key_pattern("hybridserve")):
        client.hset(key, mapping={keys.FIELD_DATA: huge, keys.FIELD_SHA256: hashlib.sha256(huge).hexdigest()})
    second = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=cache_service.address)
    assert second.run(prompt[: 2 * BLOCK] + tokens(3, 8))[2] == 0
    assert dict(second.info().prefix_cache_miss_reasons) == {"failed_verification": 1}
    assert "larger than this model's checkpoints" in caplog.text


def test_a_failing_direct_read_falls_back_to_the_service_within_the_request(
    serve, checkpoint, cache_service, redis_server
):
    first = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=cache_service.address)
    prompts = [tokens(2 * BLOCK + 5, 10), tokens(2 * BLOCK + 5, 11)]
    for prompt in prompts:
        first.run(prompt)
    assert first.engine.prefix.shared.flush()
    second = serve(checkpoint, CONFIG, prefix_caching=True, cache_address=cache_service.address)
    assert second.run(prompts[0][: 2 * BLOCK] + tokens(3, 12))[2] == 2 * BLOCK
    assert second.engine.prefix.shared.uses_direct_path
    redis_server.client().execute_command("ACL", "DELUSER", "hybridserve-worker")  # drops its connections too
    assert second.run(prompts[1][: 2 * BLOCK] + tokens(3, 13))[2] == 2 * BLOCK, "read through the service"
    assert not second.engine.prefix.shared.uses_direct_path
