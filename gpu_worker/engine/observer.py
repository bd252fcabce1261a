"""How tracing, metrics and step recording watch the engine: by consuming its records.

The engine calls one observer (a `FanOut` when there are several) on its own thread, except
`request_queued`, which runs on the submitting thread before the engine can see the request.
The default does nothing, so an engine without telemetry pays one method call per event. No
observer may raise or block for long.

The functions at the end build those records from the engine's mutable state, at the moment each
event happens (`queued_record`, `served_slices`, `finished_record`), so an observer never sees a request
that changes under it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from itertools import repeat
from operator import add, attrgetter, itemgetter
from typing import Any

from gpu_worker.engine.output import Ending
from gpu_worker.engine.prepare import PreparedStep, Row
from gpu_worker.engine.records import (
    CacheLookup,
    FirstToken,
    Occupancy,
    RequestFinished,
    RequestQueued,
    ServedSlice,
    StepRecord,
)
from gpu_worker.engine.request import Request


class EngineObserver:
    """No-op base. Subclasses override what they need."""

    def request_queued(self, event: RequestQueued) -> object | None:
        """May return a tracing context that parents the request's own calls (cache fetches)."""
        return None

    def request_first_token(self, event: FirstToken) -> None:
        """The request's first token was sampled."""

    def request_finished(self, event: RequestFinished) -> None:
        """The request ended; called before its last event reaches the client."""

    def cache_lookup(self, event: CacheLookup) -> None:
        """A prefix-cache lookup for a queued request."""

    def occupancy_changed(self, occupancy: Occupancy) -> None:
        """Queues or pools changed outside a step (start-up, new requests, aborts, deadlines)."""

    def step(self, step_index: int) -> AbstractContextManager[Any]:
        """Wraps one whole engine step. Work started inside it, including the asynchronous PlanStep
        call for the next step, runs in its context."""
        return nullcontext()

    def step_finished(self, record: StepRecord) -> None:
        """A step ran; called before the last events of the requests it finished are delivered."""

    def close(self) -> None:
        """Flushes and releases what the observer holds (files)."""


class FanOut(EngineObserver):
    """Several observers as one, called in the order given."""

    def __init__(self, observers: list[EngineObserver]) -> None:
        self.observers = tuple(observers)

    @property
    def is_active(self) -> bool:
        """False for an empty fan-out: the engine may as well keep its no-op observer."""
        return bool(self.observers)

    def request_queued(self, event: RequestQueued) -> object | None:
        context = None
        for o in self.observers:
            context = o.request_queued(event) or context
        return context

    def request_first_token(self, event: FirstToken) -> None:
        for o in self.observers:
            o.request_first_token(event)

    def request_finished(self, event: RequestFinished) -> None:
        for o in self.observers:
            o.request_finished(event)

    def cache_lookup(self, event: CacheLookup) -> None:
        for o in self.observers:
            o.cache_lookup(event)

    def occupancy_changed(self, occupancy: Occupancy) -> None:
        for o in self.observers:
            o.occupancy_changed(occupancy)

    def step(self, step_index: int) -> AbstractContextManager[Any]:
        if len(self.observers) == 1:
            return self.observers[0].step(step_index)
        return self._steps(step_index)

    @contextmanager
    def _steps(self, step_index: int) -> Iterator[None]:
        with ExitStack() as stack:
            for o in self.observers:
                stack.enter_context(o.step(step_index))
            yield

    def step_finished(self, record: StepRecord) -> None:
        for o in self.observers:
            o.step_finished(record)

    def close(self) -> None:
        for o in self.observers:
            o.close()


def queued_record(request: Request) -> RequestQueued:
    p = request.params
    return RequestQueued(
        request_id=request.request_id,
        num_prompt_tokens=len(request.prompt_token_ids),
        max_tokens=p.max_tokens,
        priority=p.priority,
        temperature=p.sampling.temperature,
        top_p=p.sampling.top_p,
        top_k=p.sampling.top_k,
        seed=p.sampling.seed,
        stop=p.stop,
        arrival_time=request.arrival_time,
    )


def finished_record(ending: Ending, now: float) -> RequestFinished:
    r = ending.request
    return RequestFinished(
        request_id=r.request_id,
        reason=ending.reason,
        error=ending.error,
        num_prompt_tokens=len(r.prompt_token_ids),
        num_cached_tokens=r.num_cached_tokens,
        num_output_tokens=len(r.output_token_ids),
        arrival_time=r.arrival_time,
        finish_time=now,
        num_draft_tokens=r.num_draft_tokens,
        num_accepted_tokens=r.num_accepted_tokens,
    )


def served_slices(prepared: PreparedStep, yielded: bool) -> tuple[ServedSlice, ...]:
    """The rows of a step that ran; `yielded` is False when its forward failed."""
    # A ServedSlice is the row's Slice (its first four fields) plus (sampled, num_output_tokens),
    # built through tuple.__new__ in C loops over the rows: this runs for every row of every step.
    rows = prepared.rows
    sampled = map(_YIELDS, rows) if yielded else repeat(False, len(rows))
    num_outputs = map(len, map(_OUTPUT_TOKEN_IDS, map(_REQUEST, rows)))
    tails = zip(sampled, num_outputs, strict=True)
    return tuple(map(tuple.__new__, repeat(ServedSlice), map(add, map(_SLICE, rows), tails)))


_REQUEST, _SLICE, _YIELDS = (itemgetter(Row._fields.index(f)) for f in ("request", "slice", "yields"))
_OUTPUT_TOKEN_IDS = attrgetter("output_token_ids")
