"""Hooks through which tracing, metrics and step recording watch the engine. The engine calls them
on its own thread (except request_queued, called on the submitting thread); the default does
nothing, so an engine without telemetry pays one method call per event."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from scheduler_svc.core import StepInput, StepPlan

if TYPE_CHECKING:
    from gpu_worker.engine.request import Request


class EngineObserver:
    """No-op base. Subclasses override what they need; none may raise or block for long."""

    def request_queued(self, request: Request) -> None:
        """A request passed admission and entered the queue."""

    def request_first_token(self, request: Request) -> None:
        """The request's first generated token was sampled."""

    def request_finished(self, request: Request, reason: str, error: Exception | None) -> None:
        """The request ended: reason "length", "stop", "abort", or "error" with the error."""

    def cache_lookup(self, tier: str, hit: bool) -> None:
        """A prefix-cache lookup for a queued request: tier "worker" (local) or "shared" (cache_svc)."""

    def step(self, step_index: int) -> AbstractContextManager[object]:
        """Wraps one whole engine step (planning wait, forward, apply). Work started inside it,
        including the asynchronous PlanStep call for the next step, runs in its context."""
        return nullcontext()

    def step_finished(
        self,
        step_index: int,
        step_input: StepInput | None,
        plan: StepPlan,
        requests: list[Request],
        plan_wait_s: float,
        plan_latency_s: float,
        wall_s: float,
    ) -> None:
        """A step ran. step_input is what the scheduler was sent for this plan (None if unknown),
        requests are those the plan served, plan_latency_s the PlanStep round trip."""
