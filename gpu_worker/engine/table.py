"""The request table: which requests the engine holds and in which queue, in service order.

    fetching  asking the shared cache tier for their prefix (not yet plannable)
    waiting   queued without a state slot (pages only of a prefix-cache hit); insertion order
    running   hold pages and a state slot; admission order

Moves between queues only; allocation is the allocator's, and the engine composes the two.
"""

from __future__ import annotations

import heapq
from concurrent.futures import Future
from itertools import count
from typing import TYPE_CHECKING

from gpu_worker.engine.request import Request
from scheduler_svc.core import RequestState

if TYPE_CHECKING:
    from gpu_worker.cache.remote import FetchResult


class RequestTable:
    def __init__(self) -> None:
        self.running: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}
        self.fetching: dict[str, tuple[Request, Future[FetchResult]]] = {}
        # Running requests whose sampling is more than a plain argmax (SamplingParams.is_plain): while
        # there is none, a step samples its rows without looking at each one.
        self.num_running_sampled = 0
        self.num_running_constrained = 0  # ... and those a grammar constrains (structured outputs)
        # (deadline, order, request) of live requests that have one, a heap: a step looks at the
        # passed ones only, not at every live request. Entries of ended requests wait to be popped.
        self._deadlines: list[tuple[float, int, Request]] = []
        self._order = count()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_plannable_work(self) -> bool:
        """Requests the scheduler can plan (fetching ones are not, yet)."""
        return bool(self.running or self.waiting)

    def live_requests(self) -> list[Request]:
        return [*self.running.values(), *self.waiting.values(), *(r for r, _ in self.fetching.values())]

    def holds(self, request_id: str) -> bool:
        """Whether some queue holds the request."""
        return request_id in self.running or request_id in self.waiting or request_id in self.fetching

    def watch_deadline(self, request: Request) -> None:
        """A new request: `late` returns it once its deadline passed, if it is still live then."""
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, next(self._order), request))

    def late(self, now: float) -> list[Request]:
        """The live requests whose deadline is before `now`, earliest first; each is returned once."""
        heap, late = self._deadlines, []
        while heap and heap[0][0] < now:
            request = heapq.heappop(heap)[2]
            rid = request.request_id
            if (self.running.get(rid) or self.waiting.get(rid) or self.fetching.get(rid, (None,))[0]) is request:
                late.append(request)
        return late

    def add_fetching(self, request: Request, fetch: Future[FetchResult]) -> None:
        self.fetching[request.request_id] = (request, fetch)

    def pop_fetched(self) -> list[tuple[Request, Future[FetchResult]]]:
        """Removes and returns the requests whose fetch finished, in queue order."""
        done = [rid for rid, (_, fetch) in self.fetching.items() if fetch.done()]
        return [self.fetching.pop(rid) for rid in done]

    def add_waiting(self, request: Request) -> None:
        self.waiting[request.request_id] = request

    def pop_waiting(self, request_id: str) -> Request | None:
        return self.waiting.pop(request_id, None)

    def add_running(self, request: Request) -> None:
        self.running[request.request_id] = request
        self.num_running_sampled += not request.params.sampling.is_plain
        self.num_running_constrained += request.grammar is not None

    def get_running(self, request_id: str) -> Request | None:
        return self.running.get(request_id)

    def pop_running(self, request_id: str) -> Request | None:
        request = self.running.pop(request_id, None)
        if request is not None:
            self.num_running_sampled -= not request.params.sampling.is_plain
            self.num_running_constrained -= request.grammar is not None
        return request

    def pop_live(self, request_id: str) -> Request | None:
        """Removes a request from whichever queue holds it."""
        fetching = self.fetching.pop(request_id, None)
        if fetching is not None:
            return fetching[0]
        return self.pop_running(request_id) or self.waiting.pop(request_id, None)

    def sched_states(self, yielding_ids: set[str] | None) -> tuple[tuple[RequestState, ...], tuple[RequestState, ...]]:
        """The scheduler's view of running and waiting requests; those in `yielding_ids` (every
        running request when None: a steady decode step) are counted with the token the step in
        flight will add."""
        if yielding_ids is None:
            running = tuple([r.sched_state(1) for r in self.running.values()])
        else:
            running = tuple([r.sched_state(rid in yielding_ids) for rid, r in self.running.items()])
        return running, tuple([r.sched_state() for r in self.waiting.values()])
