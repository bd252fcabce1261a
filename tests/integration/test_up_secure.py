"""`hybridserve up` is secure by default: its Redis refuses anonymous clients, its cache service
refuses calls without the stack's cluster token, no secret shows in `ps` or in any log; `up --tls`
serves `hybridserve generate` over mTLS and refuses a client without the stack's certificate."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridserve.client_security import ClientSecurity, open_client_channel
from hybridserve.tls import TlsSettings
from hybridserve.v1 import cache_pb2, cache_pb2_grpc
from tests.integration.test_up_generate import START_TIMEOUT_S, UpProcess, assert_gone

pytestmark = pytest.mark.slow
SECRET_VARIABLES = (
    "HYBRIDSERVE_CLUSTER_TOKEN",
    "HYBRIDSERVE_WORKER_CHECKPOINT_KEY",
    "HYBRIDSERVE_CACHE_REDIS_PASSWORD",
)
ENDPOINT = re.compile(r"^\s+(\w+)\s+(\S+:\d+)", re.MULTILINE)


def up_command(home: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hybridserve_cli", "up", "--home", str(home), "--scheduler-port", "0",
            "--worker-port", "0", "--cache-port", "0", "--gateway-port", "0", "--gateway-grpc-port", "0",
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybridserve-home")


@pytest.fixture
def stack(home) -> Iterator[tuple[UpProcess, dict[str, str]]]:
    up = UpProcess(up_command(home))
    try:
        up.endpoints(START_TIMEOUT_S)
        yield up, dict(ENDPOINT.findall("".join(up.out)))
    finally:
        code = up.stop()
        assert code == 0, up.text
        assert_gone(up.child_pids(), up.text)


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_up_keeps_strangers_out_and_secrets_out_of_ps_and_logs(stack):
    up, endpoints = stack
    pids = up.child_pids()
    host, port = endpoints["redis"].rsplit(":", 1)
    anonymous = redis.Redis(host=host, port=int(port), socket_timeout=5)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.config_set("dir", "/tmp")
    with open_client_channel(endpoints["cache"]) as channel:
        with pytest.raises(grpc.RpcError) as err:
            cache_pb2_grpc.BlockCacheStub(channel).Lookup(
                cache_pb2.LookupRequest(model_fingerprint="f" * 64, block_hashes=[b"x" * 32]), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    secrets = {name: value for pid in (pids["cache"], pids["worker"]) for name, value in environ_of(pid).items()
               if name in SECRET_VARIABLES}  # fmt: skip
    assert set(secrets) == set(SECRET_VARIABLES), "the stack's secrets reach the children through the environment"
    password = secrets["HYBRIDSERVE_CACHE_REDIS_PASSWORD"]
    assert redis.Redis(host=host, port=int(port), password=password, socket_timeout=5).ping()
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, timeout=30).stdout
    generate = [sys.executable, "-m", "hybridserve_cli", "generate", "--worker", endpoints["worker"], "Hello there",
                "--max-tokens", "4"]  # fmt: skip
    result = subprocess.run(generate, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr + up.text
    for name, value in secrets.items():
        assert value not in ps, f"{name} shows in ps"
        assert value not in up.text, f"{name} shows in the stack's logs"
    for pid in pids.values():
        if Path(f"/proc/{pid}").exists():
            assert not [v for v in secrets.values() if v in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]


def test_up_tls_serves_generate_over_mtls_and_refuses_strangers(home):
    up = UpProcess(up_command(home, "--tls", "--no-cache"))
    try:
        up.endpoints(START_TIMEOUT_S)
        endpoints = dict(ENDPOINT.findall("".join(up.out)))
        hint = next(line for line in "".join(up.out).splitlines() if line.startswith("try: "))
        words = shlex.split(hint.removeprefix("try: "))
        assert words[:2] == ["hybridserve", "generate"] and "--tls-ca" in words, hint
        flags = words[3:]
        if "--worker" in flags:
            del flags[flags.index("--worker") : flags.index("--worker") + 2]
        command = [sys.executable, "-m", "hybridserve_cli", "generate", "Hello", "--max-tokens", "4", *flags,
                   "--worker", endpoints["worker"]]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDSERVE_")}
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 0 and "completion_tokens=4" in result.stderr, result.stderr + up.text
        gateway_grpc = re.search(r"gRPC Generation API on (\S+:\d+)\)", up.text).group(1)  # as announced
        through_gateway = [*command[:-2], "--worker", gateway_grpc]
        result = subprocess.run(through_gateway, capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 0, result.stderr + up.text
        ca = Path(flags[flags.index("--tls-ca") + 1])
        for target in (endpoints["worker"], endpoints["scheduler"], gateway_grpc):
            for tls in (TlsSettings(), TlsSettings(tls_ca=ca)):  # plaintext; TLS without a client certificate
                with open_client_channel(target, ClientSecurity(tls)) as channel:
                    with pytest.raises(grpc.RpcError) as err:
                        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (target, tls)
    finally:
        code = up.stop()
    assert code == 0, up.text
    assert not ca.exists(), "the throwaway CA is removed with the stack"
    assert_gone(up.child_pids(), up.text)
