"""The cache service as a real process over a real Redis: its memory policy survives a Redis
restart, wrong credentials stop it at start, and SIGTERM lets a fetch in flight finish."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_svc.embedded_redis import RedisProcess
from hybridserve.v1 import cache_pb2 as pb
from hybridserve.v1 import cache_pb2_grpc
from tests.procs import ServerProcess

pytestmark = pytest.mark.slow

FP = "e" * 64
MAX_MEMORY_MB = 48


def cache_process(redis: RedisProcess, *extra: str, env: dict[str, str] | None = None) -> ServerProcess:
    """A cache service over `redis`; when it does not start, `redis` is stopped too (nothing leaks)."""
    try:
        return _cache_process(redis, *extra, env=env)
    except BaseException:
        redis.stop()
        raise


def _cache_process(redis: RedisProcess, *extra: str, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(
        [
            "cache",
            "--redis",
            redis.url,
            "--port",
            "0",
            "--max-memory-mb",
            str(MAX_MEMORY_MB),
            "--allow-anonymous",
            *extra,
        ],
        env=env,
    )


def policy(redis: RedisProcess) -> tuple[int, str]:
    client = redis.client()
    try:
        return int(client.config_get("maxmemory")["maxmemory"]), client.config_get("maxmemory-policy")[
            "maxmemory-policy"
        ]
    finally:
        client.close()


def publish(stub: cache_pb2_grpc.BlockCacheStub, block_hash: bytes, data: bytes) -> None:
    stub.Publish(
        pb.PublishRequest(model_fingerprint=FP, block_hash=block_hash, block_size=16, checkpoint=data,
                          checksum=hashlib.sha256(data).digest()),
        timeout=30,
    )  # fmt: skip


def readiness(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5).status


def wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_memory_policy_is_back_after_redis_restarts_on_the_same_port():
    redis = RedisProcess()
    cache = cache_process(redis)
    try:
        assert policy(redis) == (MAX_MEMORY_MB << 20, "volatile-lru")
        redis.kill()
        assert wait_for(lambda: readiness(cache.address) == health_pb2.HealthCheckResponse.NOT_SERVING)
        redis = RedisProcess(port=redis.port)  # a fresh Redis: maxmemory 0, noeviction
        # No call reaches the cache service: its own readiness probe reconnects and repairs Redis.
        assert wait_for(lambda: policy(redis) == (MAX_MEMORY_MB << 20, "volatile-lru")), policy(redis)
        assert wait_for(lambda: readiness(cache.address) == health_pb2.HealthCheckResponse.SERVING)
        assert "restarted?" in cache.output
        with grpc.insecure_channel(cache.address) as channel:
            stub = cache_pb2_grpc.BlockCacheStub(channel)
            publish(stub, b"r" * 32, b"after the restart")
            assert (
                stub.Lookup(pb.LookupRequest(model_fingerprint=FP, block_hashes=[b"r" * 32]), timeout=5).num_hit_blocks
                == 1
            )
    finally:
        cache.stop()
        redis.stop()


@pytest.mark.parametrize("password", ["wrong-password", None])
def test_wrong_or_missing_redis_password_stops_the_cache_service_at_start(password):
    redis = RedisProcess(password="the-right-one")
    env = {"HYBRIDSERVE_CACHE_REDIS_PASSWORD": password or ""}
    try:
        with pytest.raises(RuntimeError) as err:
            _cache_process(redis, env=env)
        output = str(err.value)
        assert "refused the credentials" in output and "HYBRIDSERVE_CACHE_REDIS_PASSWORD" in output, output
        assert "the-right-one" not in output and (password is None or password not in output)
    finally:
        redis.stop()


def test_a_checkpoint_that_does_not_fit_maxmemory_is_resource_exhausted():
    redis = RedisProcess()
    cache = cache_process(redis, "--max-memory-mb", "2")
    try:
        with grpc.insecure_channel(cache.address) as channel:
            stub = cache_pb2_grpc.BlockCacheStub(channel)
            with pytest.raises(grpc.RpcError) as full:
                publish(stub, b"f" * 32, os.urandom(8 << 20))
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, full.value
            assert "maxmemory" in full.value.details()
            publish(stub, b"g" * 32, b"a small one still fits")
    finally:
        cache.stop()
        redis.stop()


def test_the_right_password_serves():
    redis = RedisProcess(password="the-right-one")
    cache = cache_process(redis, env={"HYBRIDSERVE_CACHE_REDIS_PASSWORD": "the-right-one"})
    try:
        with grpc.insecure_channel(cache.address) as channel:
            publish(cache_pb2_grpc.BlockCacheStub(channel), b"p" * 32, b"checkpoint")
        assert policy(redis)[1] == "volatile-lru"
    finally:
        cache.stop()
        redis.stop()


def test_sigterm_lets_a_fetch_in_flight_finish_and_refuses_new_calls():
    redis = RedisProcess()
    cache = cache_process(redis, "--drain-timeout-s", "30", "--max-memory-mb", "256")
    blob = os.urandom(24 << 20)  # 12 chunks: the server blocks on flow control while we hold off
    try:
        with grpc.insecure_channel(cache.address, options=[("grpc.max_receive_message_length", 8 << 20)]) as channel:
            stub = cache_pb2_grpc.BlockCacheStub(channel)
            publish(stub, b"d" * 32, blob)
            stream = stub.Fetch(pb.FetchRequest(model_fingerprint=FP, block_hash=b"d" * 32), timeout=60)
            header = next(stream)
            first = next(stream)
            cache.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)  # draining now: the stream is held open by us, not finished
            assert cache.is_running()
            with grpc.insecure_channel(cache.address) as fresh:
                with pytest.raises(grpc.RpcError) as refused:
                    cache_pb2_grpc.BlockCacheStub(fresh).Lookup(
                        pb.LookupRequest(model_fingerprint=FP, block_hashes=[b"d" * 32]), timeout=5
                    )
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = b"".join(c.data for c in stream)
        assert header.header.total_bytes == len(blob) and first.data + rest == blob
        assert cache.wait_exit(30) == 0
    finally:
        cache.stop()
        redis.stop()


def test_a_fetch_that_outlasts_the_drain_timeout_ends_with_a_clear_status():
    redis = RedisProcess()
    cache = cache_process(redis, "--drain-timeout-s", "1", "--max-memory-mb", "256")
    try:
        with grpc.insecure_channel(cache.address, options=[("grpc.max_receive_message_length", 8 << 20)]) as channel:
            stub = cache_pb2_grpc.BlockCacheStub(channel)
            publish(stub, b"s" * 32, os.urandom(24 << 20))
            stream = stub.Fetch(pb.FetchRequest(model_fingerprint=FP, block_hash=b"s" * 32), timeout=60)
            next(stream)
            cache.proc.send_signal(signal.SIGTERM)
            assert cache.wait_exit(30) == 0
            with pytest.raises(grpc.RpcError) as cut:
                for _ in stream:
                    pass
        assert cut.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), cut.value
    finally:
        cache.stop()
        redis.stop()
