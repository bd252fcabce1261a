"""What the engine does when a step planned nothing although requests wait or run.

The planner reclaims only what running requests hold (it preempts them). Pages held elsewhere are
out of its reach: a waiting request's cached-prefix hit holds references on its pages and pins the
cache entries under them, so they are neither free nor reclaimable. When such hits fill the pool,
no waiting request can be admitted and nothing runs to free a page: every plan is empty, forever.

The engine breaks the stall with one remedy per empty step, so no empty step repeats on an unchanged
state (the loop never spins), and every request either completes or ends with a clear status.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gpu_worker.engine.request import Request


class Remedy(enum.Enum):
    DROP_PREFIX = "drop_prefix"  # a waiting request gives up its cached-prefix hit and recomputes it
    PREEMPT = "preempt"  # a running request is preempted (it recomputes what it knew)
    FAIL = "fail"  # nothing holds a page that could be reclaimed: the request cannot be served


@dataclass(frozen=True, slots=True)
class StallRemedy:
    remedy: Remedy
    request_id: str


def _queue_key(request: Request) -> tuple[int, float]:
    return (request.params.priority, request.arrival_time)


def stall_remedy(waiting: list[Request], running: list[Request]) -> StallRemedy:
    """The remedy for an empty plan, cheapest first, always taken from the back of the queue (the
    planner's victim order) so the head request keeps what it holds:

    1. the latest waiting request holding pages (a prefix hit) drops them: they become free, or
       reclaimable cache once no request pins them;
    2. else the latest running request is preempted, freeing its pages;
    3. else every page is free or reclaimable and still the head waiting request cannot be
       planned: it fails (RESOURCE_EXHAUSTED) rather than wait forever.

    Requires at least one waiting or running request."""
    holding = [r for r in waiting if r.page_ids]
    if holding:
        return StallRemedy(Remedy.DROP_PREFIX, max(holding, key=_queue_key).request_id)
    if running:
        return StallRemedy(Remedy.PREEMPT, max(running, key=_queue_key).request_id)
    return StallRemedy(Remedy.FAIL, min(waiting, key=_queue_key).request_id)
