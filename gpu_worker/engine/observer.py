"""How tracing, metrics and step recording watch the engine: by consuming its records.

The engine calls one observer (a `FanOut` when there are several) on its own thread, except
`request_queued`, which runs on the submitting thread before the engine can see the request.
The default does nothing, so an engine without telemetry pays one method call per event. No
observer may raise or block for long.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

from gpu_worker.engine.records import (
    CacheLookup,
    FirstToken,
    Occupancy,
    RequestFinished,
    RequestQueued,
    StepRecord,
)


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
