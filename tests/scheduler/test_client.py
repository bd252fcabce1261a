"""SchedulerClient: balances and retries across replicas (UNAVAILABLE and RESOURCE_EXHAUSTED only), gives up
with a clear error, never retries bad input."""

from __future__ import annotations

import json
import time

import pytest

from hybridserve import grpc_server
from hybridserve.children import free_port
from hybridserve.errors import InvalidArgumentError, ResourceExhaustedError, UnavailableError
from hybridserve.v1 import scheduler_pb2 as pb
from scheduler_svc import convert
from scheduler_svc.client import SchedulerClient, channel_target, service_config
from scheduler_svc.core import plan_step
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


class FlakyScheduler:
    """A Scheduler that fails its first `failures` PlanStep calls with `error`, then plans."""

    def __init__(self, error: Exception, failures: int) -> None:
        self.error, self.failures, self.calls = error, failures, 0

    def PlanStep(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return convert.plan_to_pb(plan_step(convert.step_from_pb(request)))

    def ValidateConfig(self, request, context):
        raise NotImplementedError


def serve(servicer: FlakyScheduler):
    def add(server):
        return grpc_server.add_servicer(server, pb.DESCRIPTOR.services_by_name["Scheduler"], servicer)

    server, port, _ = grpc_server.create_server([add])
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("error", "retried"),
    [(UnavailableError("draining"), True), (ResourceExhaustedError("busy"), True), (RuntimeError("bug"), False)],
    ids=["UNAVAILABLE", "RESOURCE_EXHAUSTED", "INTERNAL"],
)
def test_only_unavailable_and_resource_exhausted_are_retried(error, retried):
    servicer = FlakyScheduler(error, failures=2)
    server, address = serve(servicer)
    client = SchedulerClient([address], deadline_s=5.0, give_up_after_s=10.0, backoff_s=0.01, max_backoff_s=0.05)
    try:
        if retried:
            assert client.plan(seed_step()).stats.num_prefill_tokens == 4096
            assert servicer.calls == 3
        else:
            with pytest.raises(UnavailableError, match="INTERNAL"):
                client.plan(seed_step())
            assert servicer.calls == 1
    finally:
        client.close()
        server.stop(None)


def test_calls_are_balanced_across_replicas():
    servicers = [FlakyScheduler(RuntimeError(), failures=0) for _ in range(2)]
    served = [serve(s) for s in servicers]
    client = SchedulerClient([address for _, address in served], deadline_s=5.0)
    try:
        for i in range(20):
            client.plan(seed_step(i))
        assert all(s.calls >= 5 for s in servicers), [s.calls for s in servicers]
    finally:
        client.close()
        for server, _ in served:
            server.stop(None)


def test_channel_target_and_retry_policy():
    assert channel_target(["127.0.0.1:1", "10.0.0.2:2"]) == "ipv4:127.0.0.1:1,10.0.0.2:2"
    assert channel_target(["[::1]:5"]) == "ipv6:[::1]:5"
    assert channel_target(["scheduler.local:50051"]) == "dns:///scheduler.local:50051"
    assert channel_target(["localhost:1", "127.0.0.1:2"]).startswith(("ipv4:", "ipv6:"))
    with pytest.raises(InvalidArgumentError, match="host:port"):
        channel_target(["no-port"])
    policy = json.loads(service_config(0.05, 1.0))
    retry = policy["methodConfig"][0]["retryPolicy"]
    assert set(retry["retryableStatusCodes"]) == {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}
    assert policy["loadBalancingConfig"] == [{"round_robin": {}}]
