"""The compose files as docker-compose 1.29 reads them: each file set renders, every service is on
host networking, every hybridserve command and probe parses against the CLI, the GPU file reserves
a GPU, and each server's grace period covers its drain."""

from __future__ import annotations

import argparse
import re
import shlex
from typing import Any

import pytest

from hybridserve_cli import COMMANDS, build_parser
from tests.deploy.compose_files import DEPLOY, FILE_SETS, HYBRIDSERVE_SERVICES, config_env, rendered_config

DRAIN_S = 30  # the default drain timeout of the worker, the schedulers and the cache service
GRACE = re.compile(r"^(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$")


@pytest.fixture(scope="module")
def configs(compose_cli: str) -> dict[str, dict[str, Any]]:
    return {name: rendered_config(files) for name, files in FILE_SETS.items()}


def parse_hybridserve(argv: list[str]) -> argparse.Namespace:
    """argv parsed by the real CLI parser; a bad flag fails the test with argparse's message."""
    chosen = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(only=chosen)
    parser.exit_on_error = False
    try:
        return parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AssertionError(f"`hybridserve {shlex.join(argv)}` does not parse: {exc}") from exc


@pytest.mark.parametrize("file_set", sorted(FILE_SETS))
def test_every_service_uses_host_networking(configs: dict[str, dict[str, Any]], file_set: str) -> None:
    config = configs[file_set]
    not_host = {name: svc.get("network_mode") for name, svc in config["services"].items()
                if svc.get("network_mode") != "host"}  # fmt: skip
    assert not not_host, f"{file_set}: services not on host networking: {not_host}"
    assert not config.get("networks"), f"{file_set}: declares networks {config.get('networks')}"


@pytest.mark.parametrize("service", HYBRIDSERVE_SERVICES)
@pytest.mark.parametrize("file_set", sorted(FILE_SETS))
def test_commands_and_probes_parse(configs: dict[str, dict[str, Any]], file_set: str, service: str) -> None:
    spec = configs[file_set]["services"][service]
    args = parse_hybridserve([str(a) for a in spec["command"]])
    assert args.command == spec["command"][0]
    probe = [str(a) for a in spec["healthcheck"]["test"]]
    if probe[1] == "hybridserve":
        health = parse_hybridserve(probe[2:])
        assert health.command == "health" and health.service == "readiness"
        assert health.address.endswith(f":{args.port}"), f"{service} probes {health.address}, listens on {args.port}"
    else:  # the gateway's HTTP readiness, through python's urllib
        assert probe[1] == "python3" and "/ready" in probe[-1]


def test_variables_move_every_port(compose_cli: str) -> None:
    moved = rendered_config(FILE_SETS["cpu-node"], config_env(
        SCHEDULER_A_PORT="41001", SCHEDULER_B_PORT="41002", WORKER_PORT="41003", CACHE_PORT="41004",
        REDIS_PORT="41005", GATEWAY_PORT="41006", GATEWAY_GRPC_PORT="41007",
    ))["services"]  # fmt: skip
    worker = parse_hybridserve([str(a) for a in moved["worker"]["command"]])
    assert (worker.port, worker.cache_address) == (41003, "127.0.0.1:41004")
    assert worker.scheduler_addresses == ("127.0.0.1:41001", "127.0.0.1:41002")
    cache = parse_hybridserve([str(a) for a in moved["cache"]["command"]])
    assert (cache.port, cache.redis_url) == (41004, "redis://127.0.0.1:41005/0")
    assert "--port 41005" in " ".join(moved["redis"]["command"])
    assert "41006" in moved["gateway"]["command"] and "41007" in moved["gateway"]["command"]


def test_dependencies_wait_for_health(configs: dict[str, dict[str, Any]]) -> None:
    services = configs["cpu-node"]["services"]
    for service, needs in {"cache": {"redis"}, "worker": {"scheduler-a", "scheduler-b", "cache"},
                           "gateway": {"worker"}}.items():  # fmt: skip
        depends = services[service]["depends_on"]
        assert set(depends) == needs and all(d["condition"] == "service_healthy" for d in depends.values())
        assert all("healthcheck" in services[n] for n in needs)


@pytest.mark.parametrize("service", ["worker", "scheduler-a", "scheduler-b", "cache"])
def test_grace_period_covers_the_drain(configs: dict[str, dict[str, Any]], service: str) -> None:
    for file_set, config in configs.items():
        if service not in config["services"]:
            continue
        grace = GRACE.match(str(config["services"][service].get("stop_grace_period", "10s")))
        assert grace is not None
        seconds = int(grace.group(1) or 0) * 60 + float(grace.group(2) or 0)
        assert seconds > DRAIN_S, f"{file_set}: {service} stop_grace_period {seconds}s <= drain {DRAIN_S}s"


def test_gpu_file_reserves_a_gpu_for_the_worker_only(configs: dict[str, dict[str, Any]]) -> None:
    services = configs["gpu-node"]["services"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert services["worker"]["build"]["args"]["BASE_IMAGE"].startswith("nvidia/cuda:")
    assert services["worker"]["ipc"] == "host"
    assert all("deploy" not in spec for name, spec in services.items() if name != "worker")


def test_redis_password_comes_from_the_env_file_only(configs: dict[str, dict[str, Any]]) -> None:
    for file_set, config in configs.items():
        redis = config["services"]["redis"]
        assert "HYBRIDSERVE_CACHE_REDIS_PASSWORD" in redis["environment"], f"{file_set}: env file not applied"
        assert "--requirepass" not in " ".join(redis["command"]), f"{file_set}: password on argv"
        assert "--maxmemory" in " ".join(redis["command"])
    text = "\n".join(p.read_text() for p in DEPLOY.glob("compose*.yaml"))
    assert "HYBRIDSERVE_CACHE_REDIS_PASSWORD:" not in text and "HYBRIDSERVE_CACHE_REDIS_PASSWORD=" not in text


def test_files_use_nothing_compose_v2_only() -> None:
    """docker-compose 1.29 rejects or ignores these; GPU nodes run v2, the test runs 1.29."""
    for path in DEPLOY.glob("compose*.yaml"):
        text = path.read_text()
        for v2_only in ("\ninclude:", "\nname:", "!reset", "!override", "develop:", "required: false"):
            assert v2_only not in text, f"{path.name} uses {v2_only.strip()!r}, which docker-compose 1.29 lacks"


def test_the_model_and_its_hub_cache_live_in_the_models_volume(configs: dict[str, dict[str, Any]]) -> None:
    for file_set, config in configs.items():
        worker, gateway = config["services"]["worker"], config["services"]["gateway"]
        assert worker["environment"]["HF_HUB_CACHE"] == "/models/hub"
        assert "HYBRIDSERVE_WORKER_MODEL" in worker["environment"], file_set
        # the gateway mounts no model: its tokenizer and template come from the workers (GetModelFiles)
        assert not gateway.get("volumes") and "HF_HUB_CACHE" not in gateway["environment"], file_set
        assert parse_hybridserve([str(a) for a in gateway["command"]]).model is None, file_set
    with_id = rendered_config(FILE_SETS["cpu-node"], config_env(MODEL="ibm-granite/granite-4.0-h-tiny"))
    services = with_id["services"]
    assert services["worker"]["environment"]["HYBRIDSERVE_WORKER_MODEL"] == "ibm-granite/granite-4.0-h-tiny"
    assert parse_hybridserve([str(a) for a in services["gateway"]["command"]]).model is None


def test_gpu_worker_sizes_its_pools_from_the_device(configs: dict[str, dict[str, Any]]) -> None:
    cpu = parse_hybridserve([str(a) for a in configs["cpu-node"]["services"]["worker"]["command"]])
    gpu = parse_hybridserve([str(a) for a in configs["gpu-node"]["services"]["worker"]["command"]])
    assert cpu.memory_budget_bytes == 1024 << 20 and gpu.memory_budget_bytes == 0  # 0: from the device
    assert gpu.gpu_memory_utilization == 0.9
    same = ("scheduler_addresses", "cache_address", "port", "block_size", "max_num_seqs", "metrics_port")
    assert all(getattr(cpu, f) == getattr(gpu, f) for f in same)
