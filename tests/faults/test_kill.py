"""kill -9 of each component under 64 concurrent streams, against real processes (Redis, the cache
service, a scheduler, a worker): every accepted request either completes with the tokens of a cold
reference run or ends with a clear status within its deadline; none hangs; the worker's pools are
free afterwards (GetInfo); the service resumes once the component is back."""

from __future__ import annotations

import time

import pytest

from tests.faults.stack import (
    KV_PAGE_SIZE,
    MAX_MEMORY_MB,
    Stack,
    health_check_s,
    health_status_name,
    prompts,
    run_streams,
    serves,
    tally,
)

pytestmark = pytest.mark.slow

N = 64
MAX_TOKENS = 12
DEADLINE_S = 60.0
OUTAGE_S = 1.0
PROMPTS = prompts(N)


@pytest.fixture(scope="module")
def reference(stack: Stack) -> list[list[int]]:
    """The tokens of a cold run (nothing cached anywhere yet), the same 64 streams at once."""
    outcomes = run_streams(stack.worker_address, PROMPTS, MAX_TOKENS, DEADLINE_S)
    assert tally(outcomes) == {"completed": N}, [o.details for o in outcomes if o.kind != "completed"][:3]
    return [o.tokens for o in outcomes]


def kill_under_load(stack: Stack, reference: list[list[int]], name: str) -> list:
    def fault() -> None:
        stack.wait_progress(2 * N)  # a few steps in: every stream is accepted, most are mid-generation
        stack.kill(name)
        time.sleep(OUTAGE_S)
        stack.start(name)

    outcomes = run_streams(stack.worker_address, PROMPTS, MAX_TOKENS, DEADLINE_S, expected=reference, during=fault)
    bad = [(i, o.kind, o.code, o.details) for i, o in enumerate(outcomes) if o.kind not in ("completed", "clear error")]
    assert not bad, (tally(outcomes), bad[:5])
    assert max(o.elapsed_s for o in outcomes) < DEADLINE_S
    return outcomes


def assert_pools_free(stack: Stack) -> None:
    """Nothing runs or waits and every state slot is free; the KV pages not free are only ones the
    local prefix tier may give back: one request that needs every page of the pool is served."""
    info = stack.wait_quiet()
    assert info.num_running == 0 and info.num_waiting == 0, info
    assert info.num_state_slots_free == info.num_state_slots_total, info
    longest = min(info.num_kv_pages_total * KV_PAGE_SIZE, info.max_model_len)
    whole_pool = prompts(1, length=longest - MAX_TOKENS, seed=7)[0]
    tokens = serves(stack.worker_address, whole_pool, MAX_TOKENS, timeout_s=60)
    assert tokens is not None and len(tokens) == MAX_TOKENS, "a request that needs the whole pool is served"


def assert_resumes(stack: Stack, seed: int) -> None:
    """A new request is served with the same tokens twice (cold, then through the caches)."""
    prompt = prompts(1, seed=seed)[0]
    first = serves(stack.worker_address, prompt, MAX_TOKENS, timeout_s=30)
    assert first is not None and len(first) == MAX_TOKENS
    assert serves(stack.worker_address, prompt, MAX_TOKENS, timeout_s=30) == first


def test_scheduler_killed_under_64_streams(stack, reference):
    outcomes = kill_under_load(stack, reference, "scheduler")
    assert tally(outcomes) == {"completed": N}, "an outage shorter than --scheduler-give-up-s loses nothing"
    assert_pools_free(stack)
    assert_resumes(stack, seed=101)


def test_worker_killed_under_64_streams(stack, reference):
    outcomes = kill_under_load(stack, reference, "worker")
    counts = tally(outcomes)
    assert counts["clear error"] > 0, "the kill happened while streams were open"
    assert {o.code.name for o in outcomes if o.code is not None} <= {"UNAVAILABLE", "CANCELLED"}
    assert_pools_free(stack)
    assert_resumes(stack, seed=102)
    # The shared tier (Redis through the cache service) still holds the reference's blocks: the new
    # worker's hits import them and must reproduce the cold tokens (and its local tier is warm again).
    again = run_streams(stack.worker_address, PROMPTS, MAX_TOKENS, DEADLINE_S, expected=reference)
    assert tally(again) == {"completed": N}, [o.details for o in again if o.kind != "completed"][:3]


def test_cache_service_killed_under_64_streams(stack, reference):
    outcomes = kill_under_load(stack, reference, "cache")
    assert tally(outcomes) == {"completed": N}, "the shared tier is optional: its loss is a miss"
    assert_pools_free(stack)
    assert_resumes(stack, seed=103)
    assert health_check_s(stack.cache_address)[1] is not None


def test_redis_killed_under_64_streams(stack, reference):
    outcomes = kill_under_load(stack, reference, "redis")
    assert tally(outcomes) == {"completed": N}, "the shared tier is optional: its loss is a miss"
    assert_pools_free(stack)
    assert stack.redis is not None
    client = stack.redis.client()
    deadline = time.monotonic() + 20
    while int(client.config_get("maxmemory")["maxmemory"]) != MAX_MEMORY_MB << 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert int(client.config_get("maxmemory")["maxmemory"]) == MAX_MEMORY_MB << 20, "memory policy back"
    assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
    assert_resumes(stack, seed=104)
    deadline = time.monotonic() + 20
    while client.dbsize() == 0 and time.monotonic() < deadline:  # publishes land in the new Redis
        time.sleep(0.1)
    assert client.dbsize() > 0
    client.close()


@pytest.mark.parametrize("name", ["scheduler", "cache"])
def test_sigterm_of_scheduler_or_cache_under_64_streams_loses_nothing(stack, reference, name):
    """A rolling restart: the old process drains its calls in flight and exits cleanly; the worker
    carries on through the gap."""
    exit_codes: list[int] = []

    def restart() -> None:
        stack.wait_progress(2 * N)
        exit_codes.append(stack.terminate(name))
        stack.start(name)

    outcomes = run_streams(stack.worker_address, PROMPTS, MAX_TOKENS, DEADLINE_S, expected=reference, during=restart)
    assert tally(outcomes) == {"completed": N}, [o.details for o in outcomes if o.kind != "completed"][:3]
    assert exit_codes == [0]
    assert_pools_free(stack)


def test_worker_is_unready_while_no_scheduler_answers_and_ready_again_after(stack):
    stack.kill("scheduler")
    try:
        deadline = time.monotonic() + 15
        status = health_check_s(stack.worker_address)[1]
        while health_status_name(status) != "NOT_SERVING" and time.monotonic() < deadline:
            time.sleep(0.2)
            status = health_check_s(stack.worker_address)[1]
        assert health_status_name(status) == "NOT_SERVING"
        assert health_status_name(health_check_s(stack.worker_address, "liveness")[1]) == "SERVING"
    finally:
        stack.start("scheduler")
    deadline = time.monotonic() + 15
    while health_status_name(health_check_s(stack.worker_address)[1]) != "SERVING" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert health_status_name(health_check_s(stack.worker_address)[1]) == "SERVING"
