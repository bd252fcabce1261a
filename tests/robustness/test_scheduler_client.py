"""The worker's scheduler client under an outage: the give-up time counts once per outage (a call
made during it gives up with the others), calls after it fail at once, and an answer (a call or the
readiness probe) starts a fresh give-up budget."""

from __future__ import annotations

import threading
import time

import pytest

from hybridserve.children import free_port
from hybridserve.errors import UnavailableError
from scheduler_svc.client import SchedulerClient
from scheduler_svc.server import create_server
from tests.scheduler.helpers import seed_step

GIVE_UP_S = 1.5


def test_a_call_made_during_an_outage_gives_up_with_the_first_and_later_ones_fail_at_once():
    client = SchedulerClient([f"127.0.0.1:{free_port()}"], deadline_s=0.3, give_up_after_s=GIVE_UP_S)
    ended: dict[str, float] = {}

    def call(name: str) -> None:
        with pytest.raises(UnavailableError, match="no scheduler answered"):
            client.plan(seed_step())
        ended[name] = time.monotonic()

    try:
        started = time.monotonic()
        first = threading.Thread(target=call, args=("first",))
        first.start()
        time.sleep(GIVE_UP_S * 0.6)
        second_started = time.monotonic()
        call("second")
        first.join(10)
        assert ended["first"] - started >= GIVE_UP_S
        assert ended["second"] - second_started < GIVE_UP_S * 0.7, "the second call did not start its own give-up"
        late_started = time.monotonic()
        call("late")
        assert ended["late"] - late_started < GIVE_UP_S * 0.5
        assert not client.is_reachable(timeout_s=0.2)
    finally:
        client.close()


def test_an_answer_ends_the_outage():
    port = free_port()
    client = SchedulerClient([f"127.0.0.1:{port}"], deadline_s=0.3, give_up_after_s=GIVE_UP_S, max_backoff_s=0.2)
    try:
        with pytest.raises(UnavailableError):
            client.plan(seed_step())
        server, _, _ = create_server("127.0.0.1", port)
        server.start()
        try:
            deadline = time.monotonic() + 10
            while not client.is_reachable(timeout_s=0.5):
                assert time.monotonic() < deadline, "the scheduler's return was not seen"
            assert client.plan(seed_step()).stats.num_prefill_tokens == 4096
        finally:
            server.stop(None)
    finally:
        client.close()
