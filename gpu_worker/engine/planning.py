"""How the engine gets its plans: now (the step waits), or ahead (step N+1's plan while step N runs),
either on the planner thread or inline, made by the engine thread itself during a forward that runs
elsewhere (the model process), when that thread would only wait.

The planner alone decides what a step does, remedies included: the step input tells it which pages
waiting requests' prefix-cache hits pin (StepInput.pinned_kv_pages), and where nothing else can
progress the plan says which hits to drop or which request to fail (scheduler_svc/core/remedies.py).
The engine applies the plan (gpu_worker/engine/prepare.py, Engine._unstall); it second-guesses none.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from gpu_worker.runner.protocol import DECODE_ROW_TOKENS, FORWARD_FIXED_TOKENS
from scheduler_svc.core import SchedulerConfig, ShareState, StepInput, StepPlan
from scheduler_svc.core.share import StepCost, next_share

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


class ShareAccountant:
    """The prefill compute share's accounting (scheduler_svc/core/share.py), kept by the engine thread
    and sent with every step input (`state`; None with no share mode). After each step it refines the
    step-time cost model, then advances the decayed service times and the target. The step's service
    time is its wall time less the wait for the plan.

    The cost model is measured in two parts, each a fifth of the way a step: decode-only steps teach
    the decode part (a forward of FORWARD_FIXED_TOKENS units plus DECODE_ROW_TOKENS units a row, the
    weights the model processes' split uses, scaled to seconds), and steps with prefill teach the
    seconds per prefill token from what is left of their time after that decode part. One shared
    scale for both would charge prefill for decode rows that cost more than the split's weights say."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.state = ShareState(target=config.prefill_share) if config.has_prefill_share else None
        self._decode_unit_s: float | None = None  # seconds per decode cost unit, learned
        self._prefill_token_s: float | None = None  # seconds per prefill token, learned
        self._last_time_s: float | None = None  # monotonic seconds of the last update

    def _learn(self, prefill_tokens: int, decode_rows: int, service_s: float) -> None:
        if service_s <= 0:
            return
        if decode_rows and not prefill_tokens:
            seen = service_s / (FORWARD_FIXED_TOKENS + DECODE_ROW_TOKENS * decode_rows)
            old = self._decode_unit_s
            self._decode_unit_s = seen if old is None else 0.8 * old + 0.2 * seen
        elif prefill_tokens:
            unit = self._decode_unit_s
            if unit is None:  # nothing decoded yet: the split's weights for the whole step
                unit = service_s / (FORWARD_FIXED_TOKENS + DECODE_ROW_TOKENS * decode_rows + prefill_tokens)
            decode_part = unit * (FORWARD_FIXED_TOKENS + DECODE_ROW_TOKENS * decode_rows)
            seen = max(service_s - decode_part, 0.05 * service_s) / prefill_tokens
            old = self._prefill_token_s
            self._prefill_token_s = seen if old is None else 0.8 * old + 0.2 * seen

    def step_finished(self, step_input: StepInput | None, plan: StepPlan, prefill_tokens: int, decode_rows: int,
                      service_s: float, end_time_s: float) -> None:  # fmt: skip
        if self.state is None or step_input is None:
            return
        self._learn(prefill_tokens, decode_rows, service_s)
        state = self.state
        if self._decode_unit_s is not None:
            state = replace(state, decode_row_s=self._decode_unit_s * DECODE_ROW_TOKENS,
                            forward_s=self._decode_unit_s * FORWARD_FIXED_TOKENS)  # fmt: skip
        if self._prefill_token_s is not None:
            state = replace(state, prefill_token_s=self._prefill_token_s)
        elapsed_s = end_time_s - self._last_time_s if self._last_time_s is not None else service_s
        self._last_time_s = end_time_s
        cost = StepCost(service_s, prefill_tokens, decode_rows, plan.stats.num_pending_prefills > 0, decode_rows > 0)
        self.state = next_share(state, self.config, step_input, cost, elapsed_s)
