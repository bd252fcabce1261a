"""Fixtures: the worker tests' tiny checkpoint, in-process scheduler and workers on real gRPC; the
cache tests' real Redis and BlockCache server; the gateway tests' init-model checkpoint (byte
tokenizer) for worker processes; and a scheduler process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cache.conftest import cache_service, redis_server
from tests.gateway.conftest import model_dir
from tests.procs import ServerProcess
from tests.robustness import procs
from tests.worker.conftest import checkpoint, hf_model, scheduler_address, start_worker

__all__ = [
    "cache_service", "checkpoint", "hf_model", "model_dir", "redis_server", "scheduler_address", "start_worker",
]  # fmt: skip


@pytest.fixture(scope="module")
def scheduler_process() -> Iterator[ServerProcess]:
    with procs.scheduler() as proc:
        yield proc
