"""What `hybridserve up` hands each child (up_security.StackSecrets), without starting anything."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from hybridserve_cli.up_security import StackSecrets, is_loopback


@pytest.fixture
def made():
    created: list[StackSecrets] = []

    def make(host: str = "127.0.0.1", tls: bool = False, api_key_file=None) -> StackSecrets:
        created.append(StackSecrets.create(host, tls, api_key_file))
        return created[-1]

    yield make
    for secrets in created:
        secrets.close()
        assert not secrets.directory.exists()


def test_every_stack_gets_fresh_secrets_each_child_only_its_own(made):
    one, two = made(), made()
    assert one.cluster_token != two.cluster_token and one.checkpoint_key != two.checkpoint_key
    assert stat.S_IMODE(one.directory.stat().st_mode) == 0o700
    assert set(one.env_for("cache")) == {"HYBRIDSERVE_CLUSTER_TOKEN", "HYBRIDSERVE_CACHE_REDIS_PASSWORD"}
    assert set(one.env_for("worker")) == {"HYBRIDSERVE_CLUSTER_TOKEN", "HYBRIDSERVE_WORKER_CHECKPOINT_KEY"}
    assert set(one.env_for("scheduler")) == {"HYBRIDSERVE_CLUSTER_TOKEN"}  # the scheduler takes the cluster token
    assert one.env_for("gateway") == {} and one.env_for("redis") == {}
    assert one.tls_flags("worker") == [] and one.client_env() == "" and one.client_flags() == ""


def test_api_keys_stay_off_on_loopback_and_on_elsewhere(made, tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    public = made("0.0.0.0")
    assert public.api_key_file is not None and stat.S_IMODE(public.api_key_file.stat().st_mode) == 0o600
    key = public.api_key_file.read_text().strip()
    assert public.env_for("gateway")["HYBRIDSERVE_API_KEYS"] == key
    worker_keys = public.env_for("worker")["HYBRIDSERVE_API_KEYS"].split(",")
    assert key in worker_keys and public.env_for("gateway")["HYBRIDSERVE_GATEWAY_WORKER_API_KEY"] in worker_keys
    assert str(public.api_key_file) in public.client_env()
    keys = tmp_path / "keys"
    keys.write_text("alpha\n# a comment\nbeta\n")
    given = made(api_key_file=keys)
    assert given.api_keys == {"alpha", "beta"} and given.api_key_file is None
    keys.write_text("# none\n")
    with pytest.raises(OSError, match="holds no key"):
        made(api_key_file=keys)


def test_tls_makes_a_ca_and_one_certificate_per_service(made):
    secrets = made(tls=True)
    flags = secrets.tls_flags("cache")
    assert flags[::2] == ["--tls-cert", "--tls-key", "--tls-client-ca", "--tls-ca"]
    assert all(secrets.directory in Path(p).parents for p in flags[1::2])
    cert, key = secrets.certs["client"]
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and f"--tls-cert {cert}" in secrets.client_flags()
    assert not list(secrets.directory.rglob("ca.key")), "the CA's key is never written"
