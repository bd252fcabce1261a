"""BlockCache keeps strangers out: the cluster token on every call, bounds on what one caller can
store; refusals logged without the secret. Real cache service, real Redis."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_svc.server import create_server
from cache_svc.store import StoreConfig
from hybridserve.grpc_auth import with_bearer
from hybridserve.v1 import cache_pb2 as pb
from hybridserve.v1 import cache_pb2_grpc

TOKEN = "cluster-token-Zq81xW"
FP = "a" * 64


@pytest.fixture
def guarded(redis_server):
    """A cache service that requires TOKEN, keeps 64 KiB per model and takes 40 KiB per Publish."""
    config = StoreConfig(redis_url=redis_server.url, max_memory_bytes=64 << 20, max_model_bytes=64 << 10)
    server, port, _, store = create_server(config, tokens=frozenset({TOKEN, "older-token"}), max_publish_bytes=40 << 10)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel
    channel.close()
    server.stop(None)
    store.close()


def publish_request(block_hash: bytes, size: int = 100) -> pb.PublishRequest:
    data = bytes([block_hash[0]]) * size
    return pb.PublishRequest(
        model_fingerprint=FP, block_hash=block_hash, block_size=16, checkpoint=data,
        checksum=hashlib.sha256(data).digest(),
    )  # fmt: skip


def calls(stub: cache_pb2_grpc.BlockCacheStub) -> dict[str, object]:
    h = b"\x01" * 32
    return {
        "Publish": lambda: stub.Publish(publish_request(h), timeout=10),
        "Lookup": lambda: stub.Lookup(pb.LookupRequest(model_fingerprint=FP, block_hashes=[h]), timeout=10),
        "Fetch": lambda: list(stub.Fetch(pb.FetchRequest(model_fingerprint=FP, block_hash=h), timeout=10)),
        "Delete": lambda: stub.Delete(pb.DeleteRequest(model_fingerprint=FP, block_hash=h), timeout=10),
    }


@pytest.mark.parametrize(
    ("token", "code"),
    [(None, grpc.StatusCode.UNAUTHENTICATED), ("wrong-token", grpc.StatusCode.UNAUTHENTICATED)],
    ids=["anonymous", "wrong-token"],
)
def test_calls_without_the_cluster_token_are_refused_and_logged_without_it(guarded, caplog, token, code):
    stub = cache_pb2_grpc.BlockCacheStub(with_bearer(guarded, token))
    caplog.set_level(logging.INFO)
    for name, call in calls(stub).items():
        with pytest.raises(grpc.RpcError) as err:
            call()  # type: ignore[operator]
        assert err.value.code() == code, name
    assert sum("refused /hybridserve.v1.BlockCache/" in r.getMessage() for r in caplog.records) == 4
    assert "wrong-token" not in caplog.text and TOKEN not in caplog.text
    health = health_pb2_grpc.HealthStub(guarded).Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING, "probes need no token"


@pytest.mark.parametrize("token", [TOKEN, "older-token"])
def test_the_cluster_token_opens_every_call(guarded, token):
    stub = cache_pb2_grpc.BlockCacheStub(with_bearer(guarded, token))
    found = calls(stub)
    found["Publish"]()  # type: ignore[operator]
    assert found["Lookup"]().num_hit_blocks == 1  # type: ignore[operator, attr-defined]
    assert b"".join(c.data for c in found["Fetch"]()) == b"\x01" * 100  # type: ignore[operator, attr-defined]
    assert found["Delete"]().deleted  # type: ignore[operator, attr-defined]
    assert found["Lookup"]().num_hit_blocks == 0  # type: ignore[operator, attr-defined]


def test_publish_size_and_bytes_per_model_are_bounded(guarded):
    stub = cache_pb2_grpc.BlockCacheStub(with_bearer(guarded, TOKEN))
    with pytest.raises(grpc.RpcError) as err:
        stub.Publish(publish_request(b"\x02" * 32, size=41 << 10), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-publish-mb" in err.value.details()
    for i in range(3):  # 3 x 20 KiB fit in 64 KiB
        stub.Publish(publish_request(bytes([10 + i]) * 32, size=20 << 10), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        stub.Publish(publish_request(b"\x20" * 32, size=20 << 10), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-model-mb" in err.value.details()
    stub.Publish(publish_request(bytes([10]) * 32, size=20 << 10), timeout=10)  # re-publishing one still fits
    other = publish_request(b"\x20" * 32, size=20 << 10)
    other.model_fingerprint = "b" * 64
    stub.Publish(other, timeout=10)  # the bound is per model
    stub.Delete(pb.DeleteRequest(model_fingerprint=FP, block_hash=bytes([11]) * 32), timeout=10)
    stub.Publish(publish_request(b"\x20" * 32, size=20 << 10), timeout=10)  # room again after a delete


def test_the_cache_command_refuses_to_start_without_a_token(redis_server):
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    command = [sys.executable, "-m", "hybridserve_cli", "cache", "--redis", redis_server.url, "--port", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode != 0 and "HYBRIDSERVE_CLUSTER_TOKEN" in result.stderr
    result = subprocess.run([*command, "--redis-password", "x"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode != 0 and "--redis-password is refused" in result.stderr
