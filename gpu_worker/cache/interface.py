"""The prefix cache as the engine uses it: a narrow interface, a no-op implementation, and the
sequence type the cache works on (its own protocol, so the cache never imports the engine).

Contract, in the order the engine calls it (all on the engine thread):

1. `start_fetch(seq)` when a request is queued: a future of blocks from the shared tier, or None.
   When it is done, `import_fetched(future)` writes them into the local tier.
2. `attach(seq)` as the request enters the waiting queue (fresh or preempted): applies the local
   hit (pages, num_computed_tokens) and pins it until `on_admit` or `on_release`.
3. `on_admit(seq)` once the request holds a state slot: restores the hit's state into it.
4. `checkpoints_for(seq, start, end)` for every block boundary a chunk [start, end) crosses or ends
   on; `register` the pending checkpoints after the forward ran, or `discard` them when it failed.
5. `on_release(seq)` when the request frees its pages (finished, preempted, aborted).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gpu_worker.cache.remote import FetchResult


class CachedSequence(Protocol):
    """What the cache reads and writes of a request."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int  # set to the hit's length by attach
    num_cached_tokens: int  # prompt tokens served from the cache
    page_ids: list[int]  # KV page table; attach puts the hit's pages here
    state_slot: int | None
    block_hashes: list[bytes]  # chained hashes of full blocks, grown lazily by the cache
    cache_salt: str  # roots the hash chain: requests of different salts share no block ("" = unsalted)
    trace_context: object | None  # parents the shared tier calls made for this sequence

    @property
    def num_tokens(self) -> int: ...

    def tokens(self, start: int, end: int) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class CacheLookup:
    """One lookup of a queued request's prefix. The worker-tier lookup is the request's outcome
    (the shared tier's blocks were imported before it)."""

    tier: str  # "worker" (local pools) or "shared" (cache_svc)
    hit: bool
    request_id: str = ""
    num_query_tokens: int = 0  # tokens of the usable full blocks looked up
    num_hit_tokens: int = 0  # of those, served from the cache
    miss_reason: str = ""  # MissReason value for the first block past the hit; "" when none was missed
    decision: str = ""  # shared tier: "fetch" or "recompute" (fetch-or-recompute); "" when not asked


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Totals since start, for GetInfo (token counts named as vLLM's hit-rate metrics)."""

    prefix_cache_queries: int = 0  # tokens looked up (usable full blocks of queued requests)
    prefix_cache_hits: int = 0  # of those, served from the cache
    num_declined_tokens: int = 0  # held by the shared tier but recomputed (fetch slower than recompute)
    miss_reasons: dict[str, int] | None = None  # lookups that stopped short, by MissReason value


@dataclass(frozen=True, slots=True)
class PendingCheckpoint:
    """A checkpoint slot the step in flight fills; registered once the forward ran."""

    seq: CachedSequence
    block_index: int  # the block whose end boundary the state is taken at
    checkpoint_id: int
    position: int  # that boundary, tokens: (block_index + 1) * block_size


class PrefixCache(ABC):
    """See the module docstring for the calling order."""

    @abstractmethod
    def start_fetch(self, seq: CachedSequence) -> Future[FetchResult] | None:
        """Asks the shared tier for blocks beyond the local hit; None when there is nothing to ask."""

    @abstractmethod
    def import_fetched(self, fetch: Future[FetchResult]) -> CacheLookup | None:
        """Writes a finished fetch's blocks into the local tier; None when the fetch failed."""

    @abstractmethod
    def attach(self, seq: CachedSequence) -> CacheLookup | None:
        """Applies the local hit to a sequence being queued; None when no lookup was made."""

    @abstractmethod
    def on_admit(self, seq: CachedSequence) -> None:
        """Restores the hit's state into the sequence's fresh state slot."""

    @abstractmethod
    def on_release(self, seq: CachedSequence) -> None:
        """The sequence gives up its pages: unpin a hit it still holds."""

    @abstractmethod
    def checkpoints_for(self, seq: CachedSequence, start: int, end: int) -> list[PendingCheckpoint]:
        """Checkpoint slots for the block boundaries in (start, end] not cached yet, in order."""

    @abstractmethod
    def register(self, pending: list[PendingCheckpoint]) -> None:
        """After the forward: the checkpointed blocks become cache entries."""

    @abstractmethod
    def discard(self, pending: list[PendingCheckpoint]) -> None:
        """The forward failed: free the pending checkpoint slots."""

    @abstractmethod
    def record_forward(self, num_prefill_tokens: int, seconds: float) -> None:
        """A forward ran: its prefill tokens and wall time feed the fetch-or-recompute rule."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """Hit-rate totals and miss reasons since start."""

    @abstractmethod
    def num_free_pages(self, free_pages: int, enough: int) -> int:
        """KV pages the scheduler may count as free, given `free_pages` free outright."""

    @abstractmethod
    def num_pinned_pages(self, seq: CachedSequence) -> int:
        """KV pages a waiting sequence's pinned hit holds alone: those giving the hit up
        (`on_release`) would make reclaimable; 0 without a hit."""

    @abstractmethod
    def make_room(self, num_pages: int) -> None:
        """Evicts unused cached blocks until `num_pages` pages are free (or nothing is left)."""

    @abstractmethod
    def close(self) -> None:
        """Stops background work (the shared tier's publisher)."""


class NoPrefixCache(PrefixCache):
    """Caching off: every request computes its whole prompt."""

    def start_fetch(self, seq: CachedSequence) -> Future[FetchResult] | None:
        return None

    def import_fetched(self, fetch: Future[FetchResult]) -> CacheLookup | None:
        return None

    def attach(self, seq: CachedSequence) -> CacheLookup | None:
        return None

    def on_admit(self, seq: CachedSequence) -> None:
        pass

    def on_release(self, seq: CachedSequence) -> None:
        pass

    def checkpoints_for(self, seq: CachedSequence, start: int, end: int) -> list[PendingCheckpoint]:
        return []

    def register(self, pending: list[PendingCheckpoint]) -> None:
        pass

    def discard(self, pending: list[PendingCheckpoint]) -> None:
        pass

    def record_forward(self, num_prefill_tokens: int, seconds: float) -> None:
        pass

    def stats(self) -> CacheStats:
        return CacheStats()

    def num_free_pages(self, free_pages: int, enough: int) -> int:
        return free_pages

    def num_pinned_pages(self, seq: CachedSequence) -> int:
        return 0

    def make_room(self, num_pages: int) -> None:
        pass

    def close(self) -> None:
        pass
