"""One stack of real processes (Redis, cache service, scheduler, worker) for the fault tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.stack import Stack, write_model


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(write_model(tmp_path_factory.mktemp("faults")))
    yield running
    running.stop()
