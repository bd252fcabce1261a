"""The compose stack for real: a private dockerd (no bridge, no iptables), the project image built
offline from a debootstrapped base and a host wheelhouse, `docker-compose up` of schedulers,
Redis, cache, worker and gateway on host networking, generation from
the host through the stack, a repeated long prompt served from the prefix cache, `down`."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridserve.children import free_ports
from tests.deploy.compose_files import FILE_SETS, compose_command, rendered_config
from tests.deploy.dockerd import Dockerd
from tests.deploy.host_tools import run
from tests.deploy.images import build_project_image, import_base_image

# Cold (no cached base rootfs or wheels) the image alone takes minutes: debootstrap, pip, build.
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(2400)]

IMAGE = "hybridserve:ci"
SERVICES = ["scheduler-a", "scheduler-b", "redis", "cache", "worker", "gateway"]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the scheduler plans the next step. " * 12


class Stack:
    """docker-compose over the CI file set, pointed at the private engine, on free host ports."""

    def __init__(self, engine: Dockerd, work: Path) -> None:
        self.engine = engine
        secrets_file = work / "secrets.env"
        secrets_file.write_text(
            f"HYBRIDSERVE_CACHE_REDIS_PASSWORD={secrets.token_urlsafe(18)}\n"
            f"HYBRIDSERVE_CLUSTER_TOKEN={secrets.token_urlsafe(18)}\n"
            f"HYBRIDSERVE_WORKER_CHECKPOINT_KEY={secrets.token_urlsafe(24)}\n"
        )
        secrets_file.chmod(0o600)
        names = ["SCHEDULER_A", "SCHEDULER_B", "WORKER", "CACHE", "REDIS", "GATEWAY", "GATEWAY_GRPC",
                 "WORKER_METRICS", "SCHEDULER_A_METRICS", "SCHEDULER_B_METRICS", "CACHE_METRICS"]  # fmt: skip
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))  # distinct (a repeat hangs the stack)
        self.env = {
            **engine.env,
            **{f"{name}_PORT": str(port) for name, port in self.ports.items()},
            "COMPOSE_PROJECT_NAME": f"hybridserve-test-{secrets.token_hex(3)}",
            "HYBRIDSERVE_IMAGE": IMAGE,
            "HYBRIDSERVE_SECRETS_FILE": str(secrets_file),
            "HEALTHCHECK_INTERVAL": "2s",
            "OTEL_TRACES_EXPORTER": "none",
            "WORKERS": f"127.0.0.1:{self.ports['WORKER']}",
            "GATEWAY_HOST": "127.0.0.1",  # loopback only, like every other service in the test
            "WORKER_MEMORY_BUDGET_MB": "128",
            "REDIS_MAXMEMORY": "256mb",
            "CACHE_MAX_MEMORY_MB": "256",
        }

    def compose(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        return run(compose_command(FILE_SETS["ci"], *args), timeout_s=timeout_s, env=self.env)

    def up(self, services: list[str]) -> None:
        """`up -d` (it waits for each service's dependencies to be healthy); the probes and logs on failure."""
        try:
            self.compose("up", "-d", "--no-build", *services, timeout_s=600)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnose()}") from None

    def container(self, service: str) -> str:
        container_id = self.compose("ps", "-q", service).stdout.strip()
        assert container_id, f"no container for {service}"
        return container_id

    def health(self, service: str) -> str:
        state = self.engine.docker("inspect", "--format", "{{json .State}}", self.container(service)).stdout
        parsed: dict[str, Any] = json.loads(state)
        if not parsed.get("Running"):
            return f"exited ({parsed.get('ExitCode')})"
        return str(parsed.get("Health", {}).get("Status", "no health check"))

    def wait_healthy(self, services: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = {service: self.health(service) for service in services}
            if all(state == "healthy" for state in states.values()):
                return
            if any(state.startswith("exited") for state in states.values()):
                break
            time.sleep(2)
        raise AssertionError(f"services not healthy: {states}\n{self.diagnose()}")

    def diagnose(self) -> str:
        """Each container's last health probe outputs and the services' last log lines."""
        ids = run(compose_command(FILE_SETS["ci"], "ps", "-q"), timeout_s=60, env=self.env, check=False).stdout.split()
        probes = [
            self.engine.docker("inspect", "--format", "{{.Name}} {{json .State.Health}}", i, check=False).stdout[-1500:]
            for i in ids
        ]
        logs = run(compose_command(FILE_SETS["ci"], "logs", "--no-color", "--tail", "40"), timeout_s=60,
                   env=self.env, check=False).stdout[-8000:]  # fmt: skip
        return "health probes:\n" + "\n".join(probes) + "\nlogs:\n" + logs


@pytest.fixture(scope="module")
def image(docker_engine: Dockerd) -> str:
    build_project_image(docker_engine, import_base_image(docker_engine), IMAGE, docker_engine.scratch("image-"))
    return IMAGE


@pytest.fixture(scope="module")
def stack(docker_engine: Dockerd, image: str) -> Iterator[Stack]:
    with tempfile.TemporaryDirectory(prefix="hybridserve-stack-") as work:
        stack = Stack(docker_engine, Path(work))
        assert_host_networking_only(stack)
        try:
            stack.up(SERVICES)
            stack.wait_healthy(SERVICES, timeout_s=600)
            yield stack
        finally:
            stack.compose("down", "--volumes", "--timeout", "60", timeout_s=300)


def assert_host_networking_only(stack: Stack) -> None:
    """Before `up`: every service of the file set is on the host network, so no bridge is made."""
    services = rendered_config(FILE_SETS["ci"], stack.env)["services"]
    assert {name: s.get("network_mode") for name, s in services.items()} == {name: "host" for name in services}


def generate(target: str, prompt: str) -> dict[str, Any]:
    result = run([sys.executable, "-m", "hybridserve_cli", "generate", "--worker", target, "--json",
                  "--max-tokens", "8", "--ignore-eos", "--timeout", "120", prompt], timeout_s=180)  # fmt: skip
    reply: dict[str, Any] = json.loads(result.stdout)
    return reply


def test_stack_serves_and_reuses_cached_prefixes(stack: Stack) -> None:
    target = f"127.0.0.1:{stack.ports['GATEWAY_GRPC']}"  # through the front door
    short = generate(target, "Hello from the compose stack")
    assert short["usage"]["completion_tokens"] > 0 and short["finish_reason"]
    cold = generate(target, LONG_PROMPT)
    warm = generate(target, LONG_PROMPT)
    assert cold["usage"]["prompt_tokens"] == warm["usage"]["prompt_tokens"] > 256
    assert warm["usage"]["cached_tokens"] > 0, f"repeated prompt was not served from the prefix cache: {warm}"
    assert warm["token_ids"] == cold["token_ids"], "greedy output changed when the prefix came from the cache"
    redis = stack.container("redis")
    count = (
        "import os, redis; "
        "password = os.environ['HYBRIDSERVE_CACHE_REDIS_PASSWORD']; "
        "print(redis.Redis(port=int(os.environ['PORT']), password=password).dbsize())"
    )
    keys = stack.engine.docker("exec", "-e", f"PORT={stack.ports['REDIS']}", redis, "python3", "-c", count).stdout
    assert int(keys) > 0, "the cache service published nothing to Redis"


def test_a_restarted_worker_reuses_prefixes_from_redis_and_its_model_volume(stack: Stack) -> None:
    """After a restart the worker's own pools are empty: a hit can only come from the shared tier
    (cache service + Redis); the default model is read from the volume, not written again."""
    prompt = LONG_PROMPT.replace("quick", "restarted")
    target = f"127.0.0.1:{stack.ports['WORKER']}"
    cold = generate(target, prompt)
    assert cold["usage"]["cached_tokens"] == 0
    stack.compose("restart", "-t", "45", "worker")
    stack.wait_healthy(["worker"], timeout_s=300)
    warm = generate(target, prompt)
    assert warm["usage"]["cached_tokens"] > 0, f"no shared-tier hit after a restart: {warm}"
    assert warm["token_ids"] == cold["token_ids"]
    logs = run(compose_command(FILE_SETS["ci"], "logs", "--no-color", "worker"), timeout_s=60, env=stack.env).stdout
    assert logs.count("writing the default model") == 1, logs[-3000:]


def test_worker_runs_as_non_root_with_the_default_model_in_its_volume(stack: Stack) -> None:
    worker = stack.container("worker")
    assert stack.engine.docker("exec", worker, "id", "-u").stdout.strip() == "10001"
    listing = stack.engine.docker("exec", worker, "ls", "/models/default").stdout.split()
    assert "config.json" in listing and "model.safetensors" in listing
    mounts = json.loads(stack.engine.docker("inspect", "--format", "{{json .Mounts}}", worker).stdout)
    assert any(m["Destination"] == "/models" and m["Type"] == "volume" for m in mounts)


def test_image_carries_no_secret_and_a_grpc_health_check(docker_engine: Dockerd, image: str) -> None:
    config = json.loads(docker_engine.docker("image", "inspect", "--format", "{{json .Config}}", image).stdout)
    assert config["User"].split(":")[0] == "10001"
    assert not [e for e in config["Env"] if "PASSWORD" in e or "TOKEN" in e or "KEY" in e.split("=")[0]]
    assert config["Healthcheck"]["Test"][-1].startswith("hybridserve health")


def test_no_bridge_network_was_created(stack: Stack) -> None:
    networks = stack.engine.docker("network", "ls", "--format", "{{.Name}} {{.Driver}}").stdout.split("\n")
    assert not [n for n in networks if n.endswith(" bridge")], networks
    links = run(["ip", "-o", "link", "show"], timeout_s=10).stdout
    assert not [line for line in links.splitlines() if " docker0:" in line or ": br-" in line], links
