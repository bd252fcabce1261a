"""Executes step plans: preemptions, page and slot allocation, the packed batch, sampling, and the
tokens' effects on each request (stops, finishes, streaming). Runs on the engine thread only."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpu_worker.batch import Batch, SequenceChunk
from gpu_worker.cache.manager import PendingCheckpoint, PrefixCacheManager
from gpu_worker.cache.remote import FetchedBlock
from gpu_worker.engine.request import Request, RequestOutput
from gpu_worker.runner import ModelRunner
from gpu_worker.sampling import sample
from hybridserve.errors import HybridServeError
from scheduler_svc.core import RequestState, StepPlan

if TYPE_CHECKING:
    from gpu_worker.engine.engine import EngineCounters
    from gpu_worker.engine.observer import EngineObserver

log = logging.getLogger("hybridserve.engine")


@dataclass(slots=True)
class PreparedStep:
    """A plan turned into runner input. `sampled[i]` is the request of batch row i when that row's
    chunk reaches the end of the request's known tokens (so the step yields its next token)."""

    batch: Batch | None
    sampled: list[Request | None] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)  # served by the batch, in row order
    checkpoints: list[PendingCheckpoint] = field(default_factory=list)  # filled by this forward

    @property
    def yielding_ids(self) -> set[str]:
        """Requests that get a new token from this step."""
        return {r.request_id for r in self.sampled if r is not None}


class StepExecutor:
    def __init__(
        self,
        runner: ModelRunner,
        counters: EngineCounters,
        observer: EngineObserver,
        prefix: PrefixCacheManager | None = None,
    ) -> None:
        self.runner = runner
        self.counters = counters
        self.observer = observer
        self.prefix = prefix
        self.running: dict[str, Request] = {}  # hold pages and a state slot; admission order
        self.waiting: dict[str, Request] = {}  # no slot; pages only of a prefix-cache hit
        self.fetching: dict[str, tuple[Request, Future[list[FetchedBlock]]]] = {}  # asking the shared tier
        self.wake: Callable[[], None] = lambda: None  # set by the engine: a fetch finished
        self._eos_ids = frozenset(runner.loaded.eos_token_ids)

    def add(self, request: Request) -> None:
        """Queues a request, after asking the shared cache tier for its prefix if that may help."""
        future = self.prefix.start_fetch(request) if self.prefix is not None else None
        if future is not None:
            self.fetching[request.request_id] = (request, future)
            future.add_done_callback(lambda _: self.wake())
            return
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        if self.prefix is not None:
            self.prefix.attach(request)
        self.waiting[request.request_id] = request

    def poll_fetches(self) -> None:
        """Moves requests whose shared-tier fetch finished into the queue (a failed fetch is a miss)."""
        for request_id, (request, future) in list(self.fetching.items()):
            if not future.done():
                continue
            del self.fetching[request_id]
            if self.prefix is not None and future.exception() is None:
                self.prefix.import_fetched(future.result())
            self._enqueue(request)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.fetching)

    def has_plannable_work(self) -> bool:
        return bool(self.running or self.waiting)

    def num_free_pages(self, enough: int) -> int:
        """Free KV pages as the scheduler should count them: cached blocks nobody uses are free
        (counted only when fewer than `enough` are free outright)."""
        if self.prefix is None:
            return self.runner.kv_pool.num_free_pages
        return self.prefix.num_free_pages(enough)

    def live_requests(self) -> list[Request]:
        return [*self.running.values(), *self.waiting.values(), *(r for r, _ in self.fetching.values())]

    def sched_states(
        self, in_flight: PreparedStep | None = None
    ) -> tuple[tuple[RequestState, ...], tuple[RequestState, ...]]:
        """The scheduler's view; with the step `in_flight`, as it will be once that step ran: each
        row that yields adds its token (computed counts were advanced when the step was prepared)."""
        yielding = in_flight.yielding_ids if in_flight is not None else set()
        running = tuple(r.sched_state(int(r.request_id in yielding)) for r in self.running.values())
        return running, tuple(r.sched_state() for r in self.waiting.values())

    # ---- plan -> batch ----------------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> PreparedStep:
        for request_id in plan.preempted_request_ids:
            self._preempt(request_id)
        chunks: list[SequenceChunk] = []
        sampled: list[Request | None] = []
        served: list[Request] = []
        checkpoints: list[PendingCheckpoint] = []
        for s in plan.slices:
            request = self.running.get(s.request_id) or self._admit(s.request_id)
            if request is None:
                continue  # finished or aborted since it was planned (async scheduling)
            start = request.num_computed_tokens
            end = start + s.num_tokens
            if end > request.num_tokens or not self._ensure_pages(request, end):
                continue
            pending = self.prefix.checkpoint_for(request, end) if self.prefix and s.ends_on_checkpoint else None
            if pending is not None:
                checkpoints.append(pending)
            chunks.append(
                SequenceChunk(
                    token_ids=request.tokens(start, end),
                    start_pos=start,
                    page_ids=tuple(request.page_ids),
                    state_slot=request.state_slot if request.state_slot is not None else -1,
                    save_checkpoint_id=pending.checkpoint_id if pending is not None else None,
                )
            )
            request.num_computed_tokens = end
            self.counters.num_computed_tokens += end - start
            served.append(request)
            sampled.append(request if end == request.num_tokens else None)
        return PreparedStep(Batch(tuple(chunks)) if chunks else None, sampled, served, checkpoints)

    def _admit(self, request_id: str) -> Request | None:
        request = self.waiting.pop(request_id, None)
        if request is None:
            return None
        request.state_slot = self.runner.state_pool.allocate_slot()
        self.running[request_id] = request
        if self.prefix is not None:
            self.prefix.on_admit(request)
        return request

    def _ensure_pages(self, request: Request, num_tokens: int) -> bool:
        need = self.runner.kv_pool.pages_for_tokens(num_tokens) - len(request.page_ids)
        if need <= 0:
            return True
        if not self.runner.kv_pool.can_allocate(need) and self.prefix is not None:
            self.prefix.make_room(need)
        if not self.runner.kv_pool.can_allocate(need):
            log.warning("no KV pages for %s although planned; preempting it", request.request_id)
            self._preempt(request.request_id)
            return False
        request.page_ids.extend(self.runner.kv_pool.allocate(need))
        return True

    def _preempt(self, request_id: str) -> None:
        request = self.running.pop(request_id, None)
        if request is None:
            return
        self._release(request)
        request.fold_for_recompute()
        self._enqueue(request)
        self.counters.num_preemptions += 1

    def _release(self, request: Request) -> None:
        if self.prefix is not None:
            self.prefix.on_release(request)
        if request.page_ids:
            self.runner.kv_pool.free(request.page_ids)
            request.page_ids = []
        if request.state_slot is not None:
            self.runner.state_pool.free_slot(request.state_slot)
            request.state_slot = None

    # ---- forward, sample, apply -------------------------------------------------------------------
    def execute(self, step: PreparedStep) -> list[Request]:
        """Runs the batch and applies the sampled tokens; returns the requests that finished."""
        if step.batch is None:
            return []
        try:
            output = self.runner.forward(step.batch)
        except Exception as exc:
            if self.prefix is not None:
                self.prefix.discard(step.checkpoints)
            log.exception("forward failed; failing the step's requests")
            error = HybridServeError(f"model forward failed: {type(exc).__name__}: {exc}")
            failed = {r.request_id for r in self.running.values()}
            return [r for rid in failed if (r := self.fail(rid, error)) is not None]
        if self.prefix is not None:
            self.prefix.register(step.checkpoints)  # before sampling frees finished requests' pages
        rows = [i for i, r in enumerate(step.sampled) if r is not None]
        if not rows:
            return []
        requests = [r for r in step.sampled if r is not None]
        result = sample(output.logits[rows], [r.params.sampling for r in requests], [r.generator for r in requests])
        finished = []
        for j, request in enumerate(requests):
            top = tuple(tuple(pair) for pair in result.top_logprobs[j])
            if self._apply_token(request, result.token_ids[j], result.logprobs[j], top):
                finished.append(request)
        return finished

    def _apply_token(self, request: Request, token_id: int, logprob: float, top: tuple[tuple[int, float], ...]) -> bool:
        """Appends one sampled token, streams it; True when the request finished (and was freed)."""
        request.output_token_ids.append(token_id)
        self.counters.num_generated_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
            self.observer.request_first_token(request)
        is_eos = token_id in self._eos_ids and not request.params.ignore_eos
        text, hit_stop = request.stop_checker.push([] if is_eos else [token_id])
        reason = ""
        if is_eos or hit_stop:
            reason = "stop"
        elif len(request.output_token_ids) >= request.params.max_tokens:
            reason = "length"
        if reason and not hit_stop:
            text += request.stop_checker.flush()
        event = RequestOutput(token_ids=(token_id,), logprobs=(logprob,), top_logprobs=(top,), text=text)
        if not reason:
            request.events.put(event)
            return False
        self.running.pop(request.request_id, None)
        self._end(request, _with_usage(event, request, reason), reason, None)
        return True

    # ---- endings from outside the step --------------------------------------------------------------
    def finish(self, request_id: str, reason: str) -> Request | None:
        """Ends a live request now (abort): frees it and sends its last event."""
        request = self._pop_live(request_id)
        if request is not None:
            self._end(request, _with_usage(RequestOutput(), request, reason), reason, None)
        return request

    def fail(self, request_id: str, error: HybridServeError) -> Request | None:
        """Ends a live request with an error (its stream raises it)."""
        request = self._pop_live(request_id)
        if request is not None:
            self._end(request, RequestOutput(error=error), "error", error)
        return request

    def _end(self, request: Request, last: RequestOutput, reason: str, error: HybridServeError | None) -> None:
        """A request left every queue: free its pages and slot, send its last event, tell the observer."""
        self._release(request)
        if error is None:
            request.finish_reason = reason
        request.events.put(last)
        self.observer.request_finished(request, reason, error)

    def _pop_live(self, request_id: str) -> Request | None:
        fetching = self.fetching.pop(request_id, None)
        if fetching is not None:
            return fetching[0]
        return self.running.pop(request_id, None) or self.waiting.pop(request_id, None)


def _with_usage(event: RequestOutput, request: Request, reason: str) -> RequestOutput:
    usage = request.usage()
    return RequestOutput(
        token_ids=event.token_ids,
        logprobs=event.logprobs,
        top_logprobs=event.top_logprobs,
        text=event.text,
        finish_reason=reason,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=usage["cached_tokens"],
        completion_tokens=usage["completion_tokens"],
    )
