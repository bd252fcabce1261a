"""Fixtures shared with the worker and cache tests: a tiny checkpoint, an in-process scheduler and
workers on real gRPC, a real Redis and a real BlockCache server."""

from __future__ import annotations

from tests.cache.conftest import cache_service, redis_server
from tests.worker.conftest import checkpoint, hf_model, scheduler_address, start_worker

__all__ = ["cache_service", "checkpoint", "hf_model", "redis_server", "scheduler_address", "start_worker"]
