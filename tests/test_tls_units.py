"""TLS settings, reflection switch and the bearer interceptor over a real in-process gRPC server."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from hybridserve import grpc_server
from hybridserve.auth import check_bearer, load_secret
from hybridserve.certs import write_stack_certs
from hybridserve.grpc_auth import with_bearer
from hybridserve.tls import TlsSettings, open_channel
from hybridserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc import service
from scheduler_svc.server import create_server


def list_services(channel: grpc.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    return [s.name for reply in replies for s in reply.list_services_response.service]


@pytest.mark.parametrize("on", [True, False])
def test_reflection_can_be_switched_off(on):
    server, port, _ = create_server(tls=TlsSettings(reflection=on))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            if on:
                assert "hybridserve.v1.Scheduler" in list_services(channel)
            else:
                with pytest.raises(grpc.RpcError) as err:
                    list_services(channel)
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(None)


def test_tls_settings_refuse_half_a_pair(tmp_path: Path):
    with pytest.raises(SystemExit, match="go together"):
        TlsSettings(tls_cert=tmp_path / "a.pem")
    with pytest.raises(SystemExit, match="needs --tls-cert"):
        TlsSettings(tls_client_ca=tmp_path / "ca.pem")
    with pytest.raises(SystemExit, match="cannot read TLS file"):
        TlsSettings(tls_cert=tmp_path / "missing.pem", tls_key=tmp_path / "missing.key").server_credentials()


def test_bearer_rules_and_secret_files(tmp_path: Path):
    keys = frozenset({"alpha", "beta"})
    assert check_bearer(frozenset(), None) is None and check_bearer(keys, "Bearer beta") is None
    assert check_bearer(keys, None)[0] == "UNAUTHENTICATED"  # type: ignore[index]
    assert check_bearer(keys, "Basic alpha")[0] == "UNAUTHENTICATED"  # type: ignore[index]
    assert check_bearer(keys, "Bearer gamma")[0] == "UNAUTHENTICATED"  # type: ignore[index]
    (tmp_path / "token").write_text("s3cret\nignored\n")
    assert load_secret(tmp_path / "token", "from-env") == "s3cret" and load_secret(None, "from-env") == "from-env"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(OSError, match="empty"):
        load_secret(tmp_path / "empty", None)


def test_a_tls_server_with_keys_serves_the_right_client_only(tmp_path: Path):
    ca, files = write_stack_certs(tmp_path / "tls", ("server", "client"))
    tls = TlsSettings(tls_cert=files["server"].cert, tls_key=files["server"].key, tls_client_ca=ca)
    server, port, _ = grpc_server.create_server([service.add_to_server], tls=tls, keys=frozenset({"k"}))
    server.start()
    client = TlsSettings(tls_cert=files["client"].cert, tls_key=files["client"].key, tls_ca=ca)
    config = scheduler_pb2.SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=16,
                                           mamba_block_size=16, kv_page_size=16)  # fmt: skip
    try:
        for key, code in (
            ("k", None),
            ("wrong", grpc.StatusCode.UNAUTHENTICATED),
            (None, grpc.StatusCode.UNAUTHENTICATED),
        ):
            with with_bearer(open_channel(f"127.0.0.1:{port}", client), key) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                if code is None:
                    assert stub.ValidateConfig(config, timeout=10) is not None
                else:
                    with pytest.raises(grpc.RpcError) as err:
                        stub.ValidateConfig(config, timeout=10)
                    assert err.value.code() == code
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(None)
