"""The client the worker uses to plan its steps.

Replicas, balancing and retries are gRPC's own: one channel whose target lists every replica,
`round_robin` across those that are connected (the service is stateless, so any replica answers
any step), and a retry policy (gRFC A6) that re-sends a call that failed with UNAVAILABLE or
RESOURCE_EXHAUSTED, which with round_robin lands on another replica. INTERNAL and UNKNOWN are never
retried: the planner is deterministic, so the same input would fail again.

What gRPC has no setting for is this client's give-up deadline: a worker keeps its requests while
the schedulers restart, for up to `give_up_after_s`. Each call waits for a connected replica
(`wait_for_ready`) for at most `deadline_s`; calls that find none are repeated until
`give_up_after_s` has passed since the outage began (the first call that found no replica), and
then UnavailableError is raised. The outage is counted once: a call made during it gives up with
the others, not `give_up_after_s` after its own start; after the give-up each call makes one short
attempt (`PROBE_S`), until a call or a readiness probe (`is_reachable`) gets an answer again.
Reconnection is bounded too: a channel retries a lost replica at most every `max_backoff_s`
(gRPC's default grows to 120 s), so a returning scheduler is found within about that.

Addresses: IP literals (host:port) become one `ipv4:` (or `ipv6:`) target. One host name is
resolved by gRPC's DNS resolver (every address it returns is a replica: a headless service); several
host names are resolved once, here, to their addresses.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from hybridserve import telemetry
from hybridserve.errors import InvalidArgumentError, UnavailableError
from hybridserve.grpc_auth import with_bearer
from hybridserve.tls import TlsSettings, open_channel
from hybridserve.v1 import scheduler_pb2 as pb
from hybridserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc import convert
from scheduler_svc.core import SchedulerConfig, StepInput, StepPlan

log = logging.getLogger("hybridserve.scheduler.client")

RETRYABLE_CODES = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")  # never INTERNAL or UNKNOWN: the planner is deterministic
MAX_ATTEMPTS = 5  # gRPC caps a retry policy at 5 attempts per call
# The call found no replica within its deadline, or the replica went away under it (a draining
# server cancels the calls it received but had not started: this client never cancels its own):
# ask again until the give-up deadline.
_WAIT_AGAIN = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
PROBE_S = 0.2  # one attempt's wait once the outage outlasted the give-up time


def _split_host_port(address: str) -> tuple[str, str]:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InvalidArgumentError(f"scheduler address {address!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), port


def _ip_version(host: str) -> int | None:
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


def channel_target(addresses: Sequence[str]) -> str:
    """The gRPC target naming every replica (see the module docstring)."""
    pairs = [_split_host_port(a) for a in addresses]
    if len(pairs) == 1 and _ip_version(pairs[0][0]) is None:
        return f"dns:///{addresses[0].strip()}"
    resolved: list[tuple[str, str]] = []
    for host, port in pairs:
        if _ip_version(host) is not None:
            resolved.append((host, port))
            continue
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            raise InvalidArgumentError(f"scheduler host {host!r} does not resolve: {exc}") from None
        resolved += sorted({(str(info[4][0]), port) for info in infos})
    versions = {_ip_version(host) for host, _ in resolved}
    if len(versions) > 1:
        raise InvalidArgumentError("scheduler addresses mix IPv4 and IPv6; give addresses of one family")
    if versions == {6}:
        return "ipv6:" + ",".join(f"[{host}]:{port}" for host, port in resolved)
    return "ipv4:" + ",".join(f"{host}:{port}" for host, port in resolved)


def service_config(backoff_s: float, max_backoff_s: float) -> str:
    """round_robin across the replicas and the retry policy, as gRPC's service config JSON."""
    return json.dumps(
        {
            "loadBalancingConfig": [{"round_robin": {}}],
            "methodConfig": [
                {
                    "name": [{"service": "hybridserve.v1.Scheduler"}],
                    "retryPolicy": {
                        "maxAttempts": MAX_ATTEMPTS,
                        "initialBackoff": f"{backoff_s}s",
                        "maxBackoff": f"{max_backoff_s}s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": list(RETRYABLE_CODES),
                    },
                }
            ],
        }
    )


class SchedulerClient:
    """Plans steps over gRPC. Thread-safe; one instance per worker.

    INVALID_ARGUMENT raises InvalidArgumentError at once; no replica answering for
    `give_up_after_s` raises UnavailableError, and so does any other failure (not retried)."""

    def __init__(
        self,
        addresses: Sequence[str],
        deadline_s: float = 2.0,
        give_up_after_s: float = 30.0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        tracer_provider: trace.TracerProvider | None = None,
        tls: TlsSettings | None = None,
        token: str | None = None,
    ) -> None:
        """`token`: the cluster token, sent on every call (a scheduler with tokens refuses calls without one)."""
        if not addresses:
            raise InvalidArgumentError("at least one scheduler address is required")
        self.addresses = list(addresses)
        self.deadline_s = deadline_s
        self.give_up_after_s = give_up_after_s
        reconnect_ms = max(1, int(max_backoff_s * 1000))
        target = channel_target(self.addresses)
        if tls is not None and tls.dials_tls and not tls.tls_server_name and target.startswith("ipv"):
            # Several replicas by address: check each certificate against the first host dialled.
            tls = replace(tls, tls_server_name=_split_host_port(self.addresses[0])[0])
        self._channel = open_channel(
            target,
            tls,
            options=[
                ("grpc.enable_retries", 1),
                ("grpc.service_config", service_config(backoff_s, max_backoff_s)),
                # A restarted replica is found within max_backoff_s (gRPC's default waits up to 120 s).
                ("grpc.initial_reconnect_backoff_ms", min(reconnect_ms, max(1, int(backoff_s * 1000)))),
                ("grpc.min_reconnect_backoff_ms", min(reconnect_ms, max(1, int(backoff_s * 1000)))),
                ("grpc.max_reconnect_backoff_ms", reconnect_ms),
            ],
        )
        traced = with_bearer(telemetry.intercept_channel(self._channel, tracer_provider), token)  # spans, context
        self._stub = pb_grpc.SchedulerStub(traced)  # type: ignore[no-untyped-call]
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._down_since: float | None = None  # when the current outage began; None while answered
        self._answered_at = -1e9  # monotonic time of the last answer to a call or a probe

    def is_reachable(self, timeout_s: float = 1.0) -> bool:
        """Whether a replica answers (grpc.health.v1 readiness) within timeout_s: the worker's
        readiness. An answer ends the outage, so the next call gets the whole give-up time again.
        A call answered within the last timeout_s already says so: a busy worker sends no probe."""
        if self._down_since is None and time.monotonic() - self._answered_at < timeout_s:
            return True
        request = health_pb2.HealthCheckRequest(service="readiness")
        try:
            status = self._health.Check(request, timeout=timeout_s).status
        except grpc.RpcError:
            return False
        if status == health_pb2.HealthCheckResponse.SERVING:
            self._down_since = None
            self._answered_at = time.monotonic()
            return True
        return False

    def plan(self, step: StepInput) -> StepPlan:
        return convert.plan_from_pb(self.plan_pb(convert.step_to_pb_columns(step)))

    def plan_pb(self, request: pb.PlanStepRequest) -> pb.PlanStepResponse:
        response: pb.PlanStepResponse = self._call(self._stub.PlanStep, request)
        return response

    def validate_config(self, config: SchedulerConfig) -> pb.ValidateConfigResponse:
        response: pb.ValidateConfigResponse = self._call(self._stub.ValidateConfig, convert.config_to_pb(config))
        return response

    def _call(self, method: Any, request: Any) -> Any:
        down_since = self._down_since
        give_up_at = (time.monotonic() if down_since is None else down_since) + self.give_up_after_s
        while True:
            started = time.monotonic()
            timeout_s = max(PROBE_S, min(self.deadline_s, give_up_at - started))
            try:
                response = method(request, timeout=timeout_s, wait_for_ready=True)
                self._down_since = None
                self._answered_at = time.monotonic()
                return response
            except grpc.RpcError as err:
                code, details = err.code(), err.details()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidArgumentError(details) from None
                if code not in _WAIT_AGAIN:
                    raise UnavailableError(f"scheduler call failed: {code.name}: {details}") from None
                if self._down_since is None:
                    self._down_since = started  # the outage began with this attempt
                if time.monotonic() >= give_up_at:
                    raise UnavailableError(
                        f"no scheduler answered within {self.give_up_after_s:.1f}s"
                        f" (tried {', '.join(self.addresses)}; last error {code.name}: {details})"
                    ) from None
                log.warning("no scheduler answered (%s: %s); waiting for one", code.name, details)

    def close(self) -> None:
        self._channel.close()
