"""The compose file sets the deployment offers, and `docker-compose config` over them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.host_tools import run

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# Every combination an operator (or the test) uses: CPU node, GPU node, the CI stack.
FILE_SETS: dict[str, tuple[str, ...]] = {
    "cpu-node": ("compose.yaml",),
    "gpu-node": ("compose.yaml", "compose.gpu.yaml"),
    "ci": ("compose.yaml", "compose.ci.yaml"),
}
# Services that run the hybridserve image (their commands are `hybridserve` arguments).
HYBRIDSERVE_SERVICES = ("scheduler-a", "scheduler-b", "cache", "worker", "gateway")


def compose_command(file_set: tuple[str, ...], *args: str) -> list[str]:
    command = ["docker-compose"]
    for name in file_set:
        command += ["-f", str(DEPLOY / name)]
    return [*command, *args]


def rendered_config(file_set: tuple[str, ...], env: dict[str, str] | None = None) -> dict[str, Any]:
    """The merged, interpolated compose model of a file set, as docker-compose 1.29 renders it."""
    result = run(compose_command(file_set, "config"), timeout_s=60, env=env or config_env())
    config = yaml.safe_load(result.stdout)
    assert isinstance(config, dict) and config.get("services"), f"no services rendered:\n{result.stdout}"
    return config


def config_env(**overrides: str) -> dict[str, str]:
    """The environment compose interpolates from: an example secrets file unless one is given."""
    env = {**os.environ, "HYBRIDSERVE_SECRETS_FILE": str(DEPLOY / "secrets.env.example")}
    return {**env, **overrides}
