"""The client the worker uses to plan its steps: a deadline per call, retries across several
scheduler replicas (the service is stateless, so any replica answers any step), and a clear
UnavailableError when none answers within the time allowed."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import grpc

from hybridserve import telemetry
from hybridserve.errors import InvalidArgumentError, UnavailableError
from hybridserve.v1 import scheduler_pb2 as pb
from hybridserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc import convert
from scheduler_svc.core import SchedulerConfig, StepInput, StepPlan

log = logging.getLogger("hybridserve.scheduler.client")

_RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)


class SchedulerClient:
    """Plans steps over gRPC. Thread-safe; one instance per worker.

    Each call tries the replicas in turn starting from the last one that answered; a retryable
    failure moves to the next one after a short backoff, until `give_up_after_s` has passed since
    the call began. INVALID_ARGUMENT is never retried: it raises InvalidArgumentError at once.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        deadline_s: float = 2.0,
        give_up_after_s: float = 30.0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        tracer_provider: Any = None,
    ) -> None:
        if not addresses:
            raise InvalidArgumentError("at least one scheduler address is required")
        self.addresses = list(addresses)
        self.deadline_s = deadline_s
        self.give_up_after_s = give_up_after_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._channels = [grpc.insecure_channel(a) for a in self.addresses]
        traced = [telemetry.intercept_channel(c, tracer_provider) for c in self._channels]  # trace context
        self._stubs = [pb_grpc.SchedulerStub(c) for c in traced]  # type: ignore[no-untyped-call]
        self._preferred = 0

    def plan(self, step: StepInput) -> StepPlan:
        return convert.plan_from_pb(self.plan_pb(convert.step_to_pb(step)))

    def plan_pb(self, request: pb.PlanStepRequest) -> pb.PlanStepResponse:
        response: pb.PlanStepResponse = self._call("PlanStep", request)
        return response

    def validate_config(self, config: SchedulerConfig) -> pb.ValidateConfigResponse:
        response: pb.ValidateConfigResponse = self._call("ValidateConfig", convert.config_to_pb(config))
        return response

    def _call(self, method: str, request: Any) -> Any:
        started = time.monotonic()
        backoff = self.backoff_s
        attempt = 0
        last_error = ""
        while True:
            index = (self._preferred + attempt) % len(self._stubs)
            try:
                response = getattr(self._stubs[index], method)(request, timeout=self.deadline_s)
                self._preferred = index
                return response
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidArgumentError(err.details()) from None
                if code not in _RETRYABLE:
                    raise UnavailableError(f"scheduler {self.addresses[index]}: {code.name}: {err.details()}") from None
                last_error = f"{self.addresses[index]}: {code.name}: {err.details()}"
                log.warning("scheduler call failed (%s); trying the next replica", last_error)
            attempt += 1
            if attempt % len(self._stubs) == 0:  # a full round failed: back off before the next one
                elapsed = time.monotonic() - started
                if elapsed + backoff > self.give_up_after_s:
                    raise UnavailableError(
                        f"no scheduler answered within {self.give_up_after_s:.1f}s"
                        f" (tried {', '.join(self.addresses)}; last error {last_error})"
                    )
                time.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
