"""The engine loop: plan a step with the scheduler service, execute it on the model runner, apply
the sampled tokens, stream them out.

One thread owns every request, page and slot; other threads only enqueue (`submit`, `abort`) and
read counters. With asynchronous scheduling the plan of step N+1 is requested while step N runs,
from the state step N will leave behind if every scheduled decode yields one token; requests that
finish in step N are reconciled one step late (their slices in plan N+1 are skipped).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from gpu_worker.cache.manager import PrefixCacheManager
from gpu_worker.engine.observer import EngineObserver
from gpu_worker.engine.request import Request
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.engine.stepper import PreparedStep, StepExecutor
from gpu_worker.runner import ModelRunner
from hybridserve.errors import (
    DeadlineExceededError,
    HybridServeError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from scheduler_svc.core import StepInput, StepPlan

log = logging.getLogger("hybridserve.engine")

PlanFn = Callable[[StepInput], StepPlan]
Planned = tuple[StepInput, StepPlan, float]  # what was sent, the plan, the round trip in seconds


@dataclass(slots=True)
class EngineCounters:
    """Totals since start; read by GetInfo and metrics (plain ints: a stale read is harmless)."""

    num_steps: int = 0
    step_wall_seconds: float = 0.0  # whole steps: planning wait + forward + apply
    scheduler_wait_seconds: float = 0.0  # part of the above spent blocked on the scheduler
    num_preemptions: int = 0
    num_stalled_steps: int = 0
    num_generated_tokens: int = 0
    num_computed_tokens: int = 0  # tokens run through the model (prefill chunks + decodes)


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        plan: PlanFn,
        settings: EngineSettings,
        observer: EngineObserver | None = None,
        prefix: PrefixCacheManager | None = None,
    ) -> None:
        self.runner = runner
        self.settings = settings
        self.counters = EngineCounters()
        self.observer = observer or EngineObserver()
        self.prefix = prefix
        self.stepper = StepExecutor(runner, self.counters, self.observer, prefix)
        self.stepper.wake = self._wake
        if prefix is not None:
            prefix.on_lookup = self.observer.cache_lookup
        self._plan = plan
        self._cond = threading.Condition()
        self._inbox: list[Request] = []
        self._aborts: list[tuple[str, str]] = []  # (request_id, finish reason)
        self._live_ids: set[str] = set()  # admitted and not finished; guarded by _cond
        self._stopping = threading.Event()
        self._planner_pool = ThreadPoolExecutor(1, thread_name_prefix="plan")
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.step_index = 0
        config = settings.scheduler  # the most pages one step can take: every token on a new page
        self._most_pages_per_step = -(-config.max_num_batched_tokens // config.kv_page_size) + config.max_num_seqs

    # ---- called from any thread ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._planner_pool.shutdown(wait=False, cancel_futures=True)
        if self.prefix is not None:
            self.prefix.close()

    def submit(self, request: Request) -> None:
        """Queues an admitted request; raises InvalidArgumentError on a duplicate id and
        ResourceExhaustedError when the queue is full."""
        with self._cond:
            if request.request_id in self._live_ids:
                raise InvalidArgumentError(f"request_id {request.request_id!r} is already in use")
            if self.num_waiting + len(self._inbox) >= self.settings.max_queue_len:
                raise ResourceExhaustedError(
                    f"the queue is full ({self.settings.max_queue_len} waiting requests); retry later"
                )
            self._live_ids.add(request.request_id)
            self.observer.request_queued(request)  # before the engine thread can see it
            self._inbox.append(request)
            self._cond.notify_all()

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Ends a live request (freeing its pages and slot on the engine thread); False if unknown."""
        with self._cond:
            if request_id not in self._live_ids:
                return False
            self._aborts.append((request_id, reason))
            self._cond.notify_all()
            return True

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @property
    def num_running(self) -> int:
        return len(self.stepper.running)

    @property
    def num_waiting(self) -> int:
        return len(self.stepper.waiting)

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        pending: Future[Planned] | None = None
        while not self._stopping.is_set():
            self._drain_inbox()
            if not self.stepper.has_plannable_work():
                pending = None
                with self._cond:
                    if not self._inbox and not self._aborts:
                        self._cond.wait(self.settings.idle_wait_s)
                continue
            with self.observer.step(self.step_index):
                pending = self._step(pending)

    def _step(self, pending: Future[Planned] | None) -> Future[Planned] | None:
        """One step; returns the plan request of the next step when scheduling asynchronously."""
        started = time.monotonic()
        try:
            step_input, plan, latency = pending.result() if pending is not None else self._plan_timed(self._snapshot())
        except UnavailableError as exc:
            self._fail_all(exc)
            return None
        except HybridServeError as exc:  # the worker sent an inconsistent state: a bug
            log.exception("the scheduler rejected step %d", self.step_index)
            self._fail_all(UnavailableError(f"step planning failed: {exc}"))
            return None
        waited = time.monotonic() - started
        step_index = self.step_index
        self.step_index += 1
        prepared = self.stepper.prepare(plan)
        following = None
        if self.settings.async_scheduling and self.stepper.has_plannable_work():
            context = contextvars.copy_context()  # the step's trace context, for the PlanStep span
            following = self._planner_pool.submit(context.run, self._plan_timed, self._snapshot(prepared))
        finished = self.stepper.execute(prepared)
        self._forget(finished)
        wall = time.monotonic() - started
        self._count_step(plan, wall, waited)
        self.observer.step_finished(step_index, step_input, plan, prepared.requests, waited, latency, wall)
        return following

    def _plan_timed(self, step_input: StepInput) -> Planned:
        started = time.monotonic()
        plan = self._plan(step_input)
        return step_input, plan, time.monotonic() - started

    def _snapshot(self, in_flight: PreparedStep | None = None) -> StepInput:
        running, waiting = self.stepper.sched_states(in_flight)
        return StepInput(
            config=self.settings.scheduler,
            running=running,
            waiting=waiting,
            step_index=self.step_index,
            num_free_kv_pages=self.stepper.num_free_pages(self._most_pages_per_step),
        )

    def _drain_inbox(self) -> None:
        with self._cond:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for request in new:
            self.stepper.add(request)
        self.stepper.poll_fetches()
        for request_id, reason in aborts:
            self._forget([self.stepper.finish(request_id, reason)])
        now = time.monotonic()
        for request in self.stepper.live_requests():
            if request.deadline is not None and now > request.deadline:
                error = DeadlineExceededError(f"request {request.request_id} passed its deadline")
                self._forget([self.stepper.fail(request.request_id, error)])

    def _fail_all(self, error: HybridServeError) -> None:
        log.error("failing %d in-flight requests: %s", len(self.stepper.live_requests()), error)
        self._forget([self.stepper.fail(r.request_id, error) for r in self.stepper.live_requests()])

    def _forget(self, requests: list[Request | None]) -> None:
        with self._cond:
            for request in requests:
                if request is not None:
                    self._live_ids.discard(request.request_id)

    def _count_step(self, plan: StepPlan, wall: float, waited: float) -> None:
        c = self.counters
        c.num_steps += 1
        c.step_wall_seconds += wall
        c.scheduler_wait_seconds += waited
        c.num_stalled_steps += int(plan.stats.stalled)
