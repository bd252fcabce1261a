"""How the engine gets its plans: now (the step waits), or ahead (step N+1's plan while step N runs),
either on the planner thread or inline, made by the engine thread itself during a forward that runs
elsewhere (the model process), when that thread would only wait."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from scheduler_svc.core import StepInput, StepPlan

PlanFn = Callable[[StepInput], StepPlan]


@dataclass(frozen=True, slots=True)
class Planned:
    step_input: StepInput  # what the scheduler was sent
    plan: StepPlan
    latency_s: float  # the PlanStep round trip


class Planning:
    def __init__(self, plan: PlanFn) -> None:
        self._plan = plan
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="plan")
        self._inline: tuple[Future[Planned], StepInput] | None = None  # to make during the forward

    def now(self, step_input: StepInput) -> Planned:
        started = time.monotonic()
        plan = self._plan(step_input)
        return Planned(step_input, plan, time.monotonic() - started)

    def ahead(self, step_input: StepInput, inline: bool) -> Future[Planned]:
        """The plan of `step_input`, to come: made by `make_inline` when `inline`, else on the planner
        thread (in the caller's trace context, for the PlanStep span)."""
        if inline:
            planned: Future[Planned] = Future()
            self._inline = (planned, step_input)
            return planned
        return self._pool.submit(contextvars.copy_context().run, self.now, step_input)

    def make_inline(self) -> None:
        """Makes the plan `ahead(..., inline=True)` asked for, if any; its error goes to its future."""
        inline, self._inline = self._inline, None
        if inline is not None:
            planned, step_input = inline
            try:
                planned.set_result(self.now(step_input))
            except Exception as exc:  # raised to the next step by Future.result, as from the planner thread
                planned.set_exception(exc)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
