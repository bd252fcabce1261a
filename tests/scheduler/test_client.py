"""SchedulerClient: retries across replicas, gives up with a clear error, never retries bad input."""

from __future__ import annotations

import time

import pytest

from hybridserve.children import free_port
from hybridserve.errors import InvalidArgumentError, UnavailableError
from scheduler_svc.client import SchedulerClient
from tests.scheduler.helpers import config, seed_step, step


def dead_address() -> str:
    return f"127.0.0.1:{free_port()}"  # free a moment ago: nothing listens there


def test_a_dead_replica_is_skipped(scheduler_address):
    client = SchedulerClient([dead_address(), scheduler_address], deadline_s=1.0, give_up_after_s=10.0)
    try:
        plan = client.plan(seed_step())
        assert plan.stats.num_prefill_tokens == 4096
        assert client.plan(seed_step(1)).stats.num_prefill_tokens == 4096
    finally:
        client.close()


def test_no_replica_answering_raises_unavailable_in_bounded_time():
    client = SchedulerClient([dead_address(), dead_address()], deadline_s=0.2, give_up_after_s=1.0)
    started = time.monotonic()
    with pytest.raises(UnavailableError, match="no scheduler answered within 1.0s"):
        client.plan(seed_step())
    assert time.monotonic() - started < 5.0
    client.close()


def test_invalid_argument_is_raised_at_once(scheduler_address):
    client = SchedulerClient([scheduler_address], give_up_after_s=10.0)
    bad = step(config(max_num_prefill_tokens_per_step=2304), seed_step().running)
    started = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="2304"):
        client.plan(bad)
    assert time.monotonic() - started < 2.0
    assert client.validate_config(config()).quantum == 2048
    client.close()
