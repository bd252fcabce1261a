"""The engine's door: where other threads hand in requests and aborts, and the one record of which
requests are live (submitted and not ended).

Any thread may submit, abort or read; the engine thread takes what came in between steps, forgets
the requests it ended, and closes the door when its loop ends: from then on every submit raises the
error it closed with, so no request can wait on a loop that no longer runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpu_worker.engine.request import FinishReason, Request, RequestOutput
from hybridserve.errors import InvalidArgumentError, ResourceExhaustedError, UnavailableError

log = logging.getLogger("hybridserve.engine")


class Door:
    def __init__(self, max_queue_len: int) -> None:
        self.max_queue_len = max_queue_len
        self.cond = threading.Condition()
        self.inbox: list[Request] = []  # submitted, not yet taken by the engine thread
        # (id, reason, the request it is for: None = whichever is live under that id when taken)
        self.aborts: list[tuple[str, FinishReason, Request | None]] = []
        self.live: dict[str, Request] = {}  # submitted and not ended, by id
        self.closed_with: UnavailableError | None = None  # set once the engine loop ended

    def submit(self, request: Request, num_waiting: int, on_queued: Callable[[Request], None]) -> None:
        """Hands in a request; raises InvalidArgumentError on a duplicate id, ResourceExhaustedError
        when `num_waiting` plus the inbox reach the queue limit, and the closing error once closed.
        `on_queued` runs under the lock, before the engine thread can see the request."""
        with self.cond:
            if self.closed_with is not None:
                raise self.closed_with
            if request.request_id in self.live:
                raise InvalidArgumentError(f"request_id {request.request_id!r} is already in use")
            if num_waiting + len(self.inbox) >= self.max_queue_len:
                raise ResourceExhaustedError(f"the queue is full ({self.max_queue_len} waiting requests); retry later")
            self.live[request.request_id] = request
            on_queued(request)
            self.inbox.append(request)
            self.cond.notify_all()

    def abort(self, request_id: str, reason: FinishReason, only: Request | None = None) -> bool:
        """Asks the engine thread to end a live request; False if it is not live. With `only`, the
        live request of that id must be that very one: a call that ended aborts its own request, never
        a later one that reused the id."""
        with self.cond:
            live = self.live.get(request_id)
            if live is None or (only is not None and live is not only):
                return False
            self.aborts.append((request_id, reason, only))
            self.cond.notify_all()
            return True

    def take(self) -> tuple[list[Request], list[tuple[str, FinishReason]]]:
        """(engine thread) What came in since the last call. An abort for one request whose id is
        now another's (it ended, and a new request took the id) is dropped."""
        with self.cond:
            new, self.inbox = self.inbox, []
            asked, self.aborts = self.aborts, []
            aborts = [(rid, reason) for rid, reason, only in asked if only is None or self.live.get(rid) is only]
        return new, aborts

    def forget(self, request_ids: list[str]) -> None:
        """(engine thread) These requests ended."""
        with self.cond:
            for request_id in request_ids:
                self.live.pop(request_id, None)

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def wait(self, timeout_s: float) -> None:
        """(engine thread) Sleeps up to timeout_s unless something came in."""
        with self.cond:
            if not self.inbox and not self.aborts:
                self.cond.wait(timeout_s)

    def orphans(self, is_queued: Callable[[str], bool]) -> list[Request]:
        """Live requests neither in the inbox nor in a queue (`is_queued`): taken in by an iteration
        that failed before it queued them."""
        with self.cond:
            inbox = {r.request_id for r in self.inbox}
            return [r for rid, r in self.live.items() if rid not in inbox and not is_queued(rid)]

    @property
    def num_live(self) -> int:
        with self.cond:
            return len(self.live)

    def close(self, error: UnavailableError) -> None:
        """(engine thread, as its loop ends) Every live request ends with `error` (its stream raises
        it), and so does every later submit."""
        with self.cond:
            self.closed_with = error
            live, self.live = list(self.live.values()), {}
            self.inbox, self.aborts = [], []
        for request in live:
            request.events.put(RequestOutput(error=error))
        if live:
            log.warning("the engine stopped; %d live requests ended: %s", len(live), error)
