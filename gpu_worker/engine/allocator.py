"""The allocator: KV pages, live state slots and (through the prefix cache) checkpoint slots.

Lifetimes: a request holds pages for [0, num_computed_tokens) from its first chunk (or from a
prefix-cache hit while it waits) until it is released, and a state slot from admission until it is
released (finished, preempted, aborted or failed). Only the engine thread calls it.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpu_worker.cache.interface import CacheLookup, NoPrefixCache, PendingCheckpoint, PrefixCache
from gpu_worker.engine.records import Occupancy
from gpu_worker.engine.request import Request
from gpu_worker.runner.protocol import KVPagePool, MambaStatePool
from scheduler_svc.core import PinnedPages


class Allocator:
    def __init__(self, kv_pool: KVPagePool, state_pool: MambaStatePool, prefix: PrefixCache) -> None:
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.prefix = prefix
        self.checkpoints = not isinstance(prefix, NoPrefixCache)  # states are kept at block boundaries

    def attach_prefix(self, request: Request) -> CacheLookup | None:
        """A request enters the waiting queue: it takes the pages of its cached prefix, if any."""
        return self.prefix.attach(request)

    def assign_slot(self, request: Request) -> None:
        """Admission: a fresh state slot, holding the cached prefix's state when there is one."""
        request.state_slot = self.state_pool.allocate_slot()
        self.prefix.on_admit(request)

    def ensure_pages(self, request: Request, num_tokens: int) -> bool:
        """Pages for positions [0, num_tokens), evicting unused cached blocks if the pool is short;
        False when they cannot be had (the caller preempts the request)."""
        need = self.kv_pool.pages_for_tokens(num_tokens) - len(request.page_ids)
        if need <= 0:
            return True
        if not self.kv_pool.can_allocate(need):
            self.prefix.make_room(need)
        if not self.kv_pool.can_allocate(need):
            return False
        request.page_ids.extend(self.kv_pool.allocate(need))
        return True

    def checkpoints_for(self, request: Request, start: int, end: int) -> list[PendingCheckpoint]:
        """Checkpoint slots for the states at the block boundaries the chunk [start, end) reaches."""
        return self.prefix.checkpoints_for(request, start, end)

    def release(self, request: Request) -> None:
        """Frees everything the request holds."""
        self.prefix.on_release(request)
        if request.page_ids:
            self.kv_pool.free(request.page_ids)
            request.page_ids = []
        if request.state_slot is not None:
            self.state_pool.free_slot(request.state_slot)
            request.state_slot = None

    def drop_prefix(self, request: Request) -> None:
        """A waiting request gives up its cached-prefix hit (pages and pins) and will compute its
        whole prompt: the way out when such hits leave no pages to admit anyone."""
        self.release(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0  # usage: none of its prompt is served from the cache now

    def pinned_pages(self, waiting: Iterable[Request]) -> tuple[PinnedPages, ...]:
        """What the waiting requests' prefix-cache hits pin, for the scheduler (StepInput.pinned_kv_pages):
        one entry per hit that holds pages no other request holds."""
        count = self.prefix.num_pinned_pages
        return tuple([PinnedPages(r.request_id, n) for r in waiting if r.page_ids and (n := count(r))])

    def num_free_pages(self, enough: int) -> int:
        """Free KV pages as the scheduler should count them: cached blocks nobody uses are free
        (counted only when fewer than `enough` are free outright)."""
        return self.prefix.num_free_pages(self.kv_pool.num_free_pages, enough)

    def occupancy(self, num_running: int, num_waiting: int) -> Occupancy:
        kv, state = self.kv_pool, self.state_pool
        return Occupancy(
            num_running=num_running,
            num_waiting=num_waiting,
            num_kv_pages_used=kv.num_pages - kv.num_free_pages,
            num_kv_pages_total=kv.num_pages,
            num_state_slots_used=state.num_slots - state.num_free_slots,
            num_state_slots_total=state.num_slots,
        )
