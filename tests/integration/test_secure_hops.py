"""Every hop secured, with real processes: a scheduler, a Redis with a password, a cache service and a
worker, all on mTLS from one throwaway CA; the worker's Generation API behind an API key; the cache
service behind the cluster token. A client without a certificate, with one from another CA, without
the key or with a wrong one is refused; the right one is served, by `hybridserve generate` too. No
secret appears in argv or in any log."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_svc.embedded_redis import RedisProcess
from hybridserve.certs import write_stack_certs
from hybridserve.children import Child
from hybridserve.client_security import ClientSecurity, open_client_channel
from hybridserve.tls import TlsSettings
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint
from hybridserve_cli.stack import Stack

SPEC = ModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=(1, 3),
                 mamba_n_heads=4, mamba_d_state=16)  # fmt: skip
API_KEY = "api-key-7Hq2LwPz"
CLUSTER_TOKEN = "cluster-token-9vXc3Rt"
CHECKPOINT_KEY = "checkpoint-key-4bNm8Kd0s2"
REDIS_PASSWORD = "redis-password-Qe5uY1"
SECRETS = (API_KEY, CLUSTER_TOKEN, CHECKPOINT_KEY, REDIS_PASSWORD)


@dataclass
class SecureStack:
    ca: Path
    files: dict[str, tuple[Path, Path]]  # identity -> (cert, key)
    other_ca_client: tuple[Path, Path]
    redis: RedisProcess
    processes: dict[str, Child]  # scheduler, cache, worker

    def tls(self, identity: str | None = "client", ca: Path | None = None) -> TlsSettings:
        cert, key = self.files[identity] if identity else (None, None)
        return TlsSettings(tls_cert=cert, tls_key=key, tls_ca=ca or self.ca)

    @property
    def worker(self) -> str:
        return self.processes["worker"].address


def server_tls_flags(stack_ca: Path, cert: Path, key: Path) -> list[str]:
    return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(stack_ca), "--tls-ca", str(stack_ca)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[SecureStack]:
    root = tmp_path_factory.mktemp("secure")
    model = write_random_checkpoint(root / "tiny", SPEC, seed=3)
    ca, issued = write_stack_certs(root / "tls", ("scheduler", "cache", "worker", "client"))
    _, foreign = write_stack_certs(root / "other-tls", ("client",))
    files = {name: (f.cert, f.key) for name, f in issued.items()}
    redis = RedisProcess(password=REDIS_PASSWORD)
    env = {"HYBRIDSERVE_CACHE_REDIS_PASSWORD": REDIS_PASSWORD, "HYBRIDSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN,
           "HYBRIDSERVE_API_KEYS": API_KEY, "HYBRIDSERVE_WORKER_CHECKPOINT_KEY": CHECKPOINT_KEY}  # fmt: skip
    launcher = Stack(start_timeout_s=120, stop_timeout_s=30, die_with_parent=False, keep_lines=100_000)
    try:
        scheduler = launcher.scheduler(flags=server_tls_flags(ca, *files["scheduler"]))
        cache = launcher.cache(redis.url, flags=server_tls_flags(ca, *files["cache"]), env=env)
        launcher.worker(model, [scheduler], cache, flags=[
            "--device", "cpu", "--memory-budget-mb", "24", "--max-num-seqs", "2", "--block-size", "16",
            "--mamba-block-size", "8", "--num-checkpoint-slots", "32", *server_tls_flags(ca, *files["worker"]),
        ], env=env)  # fmt: skip
        processes = {s.name: s.child for s in launcher.services}
        yield SecureStack(ca, files, (foreign["client"].cert, foreign["client"].key), redis, processes)
    finally:
        launcher.stop()
        redis.stop()


def generate(channel: grpc.Channel, prompt: str = "hello secure world", max_tokens: int = 4) -> list[int]:
    request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [t for m in pb_grpc.GenerationStub(channel).Generate(request, timeout=60) for t in m.token_ids]


def test_the_right_certificate_and_key_are_served(stack):
    with open_client_channel(stack.worker, ClientSecurity(stack.tls(), API_KEY)) as channel:
        assert len(generate(channel)) == 4
        long_prompt = "a prompt longer than two blocks of sixteen bytes"
        generate(channel, long_prompt)
    assert stack.redis.client().dbsize() > 0, "the worker published to the cache service over mTLS with the token"


@pytest.mark.parametrize("how", ["plaintext", "no-client-certificate", "certificate-of-another-ca"])
def test_a_client_without_the_stacks_certificate_is_refused(stack, how):
    tls = {
        "plaintext": TlsSettings(),
        "no-client-certificate": stack.tls(None),
        "certificate-of-another-ca": TlsSettings(
            tls_cert=stack.other_ca_client[0], tls_key=stack.other_ca_client[1], tls_ca=stack.ca
        ),  # fmt: skip
    }[how]
    for target in (stack.worker, stack.processes["scheduler"].address, stack.processes["cache"].address):
        with open_client_channel(target, ClientSecurity(tls, API_KEY)) as channel:
            with pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (target, err.value)


@pytest.mark.parametrize(
    ("key", "code"), [(None, grpc.StatusCode.UNAUTHENTICATED), ("wrong-key", grpc.StatusCode.UNAUTHENTICATED)]
)
def test_generation_needs_the_api_key_and_health_does_not(stack, key, code):
    with open_client_channel(stack.worker, ClientSecurity(stack.tls(), key)) as channel:
        with pytest.raises(grpc.RpcError) as err:
            generate(channel)
        assert err.value.code() == code
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest(), timeout=10)
        assert err.value.code() == code
        probe = health_pb2.HealthCheckRequest(service="liveness")
        health = health_pb2_grpc.HealthStub(channel).Check(probe, timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_hybridserve_generate_speaks_tls_and_sends_the_key(stack):
    cert, key = stack.files["client"]
    command = [sys.executable, "-m", "hybridserve_cli", "generate", "--worker", stack.worker, "hello",
               "--max-tokens", "3", "--tls-ca", str(stack.ca), "--tls-cert", str(cert),
               "--tls-key", str(key)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDSERVE_")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**env, "HYBRIDSERVE_API_KEY": API_KEY})  # fmt: skip
    assert result.returncode == 0 and "completion_tokens=3" in result.stderr, result.stdout + result.stderr
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, refused.stderr


def test_no_secret_in_argv_or_logs(stack):
    for name, process in stack.processes.items():
        argv = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode(errors="replace")
        assert not [s for s in SECRETS if s in argv], name
        assert not [s for s in SECRETS if s in process.output], f"{name} logged a secret:\n{process.output}"
    argv = Path(f"/proc/{stack.redis.child.pid}/cmdline").read_bytes().decode(errors="replace")
    assert REDIS_PASSWORD not in argv, "redis-server's password is in its argv"
