"""A minimal worker stand-in for multi-step scheduler properties: it owns request states and a
page pool, applies each plan exactly as the worker contract says, and asserts progress."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

from scheduler_svc.core import RequestState, SchedulerConfig, StepInput, StepPlan, plan_step, rules


@dataclass
class SimRequest:
    request_id: str
    prompt: int  # grows when a preempted request folds its outputs in
    max_tokens: int  # shrinks by the folded outputs
    arrival: float
    priority: int
    computed: int = 0
    output: int = 0
    generated_total: int = 0
    finished: bool = False

    def state(self) -> RequestState:
        return RequestState(
            self.request_id, self.prompt, self.computed, self.output, self.max_tokens, self.priority, self.arrival
        )


class Simulation:
    def __init__(self, config: SchedulerConfig, requests: list[SimRequest], total_pages: int) -> None:
        self.config = config
        self.requests = requests
        self.total_pages = total_pages
        self.running: list[SimRequest] = []
        self.waiting: list[SimRequest] = list(requests)
        self.num_preemptions = 0
        self.step_index = 0

    @classmethod
    def random(cls, config: SchedulerConfig, draw: Callable, total_pages: int | None) -> Simulation:
        count = draw(st.integers(1, 8))
        requests = [
            SimRequest(
                f"q{i}",
                draw(st.integers(1, 1200)),
                draw(st.integers(1, 24)),
                float(draw(st.integers(0, 5))),
                draw(st.integers(0, 1)),
            )
            for i in range(count)
        ]
        if total_pages is None:
            need = max(rules.pages_for_tokens(r.prompt + r.max_tokens, config.kv_page_size) for r in requests)
            total_pages = need + draw(st.integers(0, 8))
        return cls(config, requests, total_pages)

    def used_pages(self) -> int:
        return sum(rules.pages_for_tokens(r.computed, self.config.kv_page_size) for r in self.running)

    def run(self, max_steps: int, check: Callable[[StepInput, StepPlan], None]) -> int:
        for steps in range(max_steps):
            if self.all_finished():
                return steps
            step = StepInput(
                self.config,
                tuple(r.state() for r in self.running),
                tuple(r.state() for r in self.waiting),
                self.step_index,
                self.total_pages - self.used_pages(),
            )
            plan = plan_step(step)
            check(step, plan)
            assert plan.slices, f"empty step {self.step_index} with work pending: {step}"
            self.apply(plan)
            self.step_index += 1
        return max_steps

    def apply(self, plan: StepPlan) -> None:
        by_id = {r.request_id: r for r in self.running + self.waiting}
        for rid in plan.preempted_request_ids:
            r = by_id[rid]
            self.running.remove(r)
            r.prompt += r.output
            r.max_tokens -= r.output
            r.computed, r.output = 0, 0
            self.waiting.append(r)
            self.num_preemptions += 1
        for s in plan.slices:
            r = by_id[s.request_id]
            if r in self.waiting:
                self.waiting.remove(r)
                self.running.append(r)
            r.computed += s.num_tokens
            if r.computed >= r.prompt:  # the step sampled a token
                r.output += 1
                r.generated_total += 1
                if r.output >= r.max_tokens:
                    r.finished = True
                    self.running.remove(r)
        assert self.used_pages() <= self.total_pages

    def all_finished(self) -> bool:
        return all(r.finished for r in self.requests)

    def describe(self) -> str:
        return f"pages {self.total_pages}, config {self.config}, requests {self.requests}"
