"""Fixtures for the deployment tests: Debian's docker-compose, and a private Docker engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.dockerd import Dockerd
from tests.deploy.host_tools import BASE_IMAGE_PACKAGES, DOCKER_PACKAGES, apt_install


@pytest.fixture(scope="session")
def compose_cli() -> str:
    """docker-compose 1.29 from Debian (installed with apt when missing; skipped where impossible)."""
    apt_install(DOCKER_PACKAGES)
    return "docker-compose"


@pytest.fixture(scope="module")
def docker_engine(compose_cli: str) -> Iterator[Dockerd]:
    """A dockerd for one test module; stopped by its PID when the module ends (not the session:
    the rest of the suite should not run beside an engine and its tmpfs), its mounts undone."""
    apt_install(BASE_IMAGE_PACKAGES)
    engine = Dockerd.start()
    try:
        yield engine
    finally:
        engine.stop()
