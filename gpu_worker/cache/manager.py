"""Prefix caching as the engine sees it: find a request's cached prefix when it is queued, restore
it when it is admitted, checkpoint blocks as chunks reach the grid, publish them to the shared tier.

Grid: the scheduler's block_size (state exists only there); KV pages stay small. A request with a
hit of k blocks is queued with num_computed_tokens = k * block_size, holding references to those
blocks' pages, and its state slot is restored from block k-1's checkpoint when it is admitted. At
least one prompt token is always left to compute, so the step that finishes the prompt yields logits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from gpu_worker.cache.blocks import chain_hashes
from gpu_worker.cache.checkpoint_io import export_block, import_block
from gpu_worker.cache.local import Hit, LocalPrefixCache
from gpu_worker.cache.remote import FetchedBlock, SharedTier
from gpu_worker.engine.request import Request
from gpu_worker.runner import ModelRunner

log = logging.getLogger("hybridserve.cache")


@dataclass(slots=True)
class PendingCheckpoint:
    """A checkpoint slot the step in flight fills; registered once the forward ran."""

    request: Request
    block_index: int  # the block that ends where the chunk ends
    checkpoint_id: int


class PrefixCacheManager:
    def __init__(self, runner: ModelRunner, block_size: int, shared: SharedTier | None = None) -> None:
        self.runner = runner
        self.block_size = block_size
        self.fingerprint = runner.loaded.fingerprint
        self.local = LocalPrefixCache(runner.kv_pool, runner.state_pool)
        self.shared = shared
        self._hits: dict[str, Hit] = {}  # request_id -> pinned hit awaiting admission
        self.on_lookup: Callable[[str, bool], None] = lambda tier, hit: None  # metrics hook
        self.num_shared_hits = 0

    # ---- queueing ---------------------------------------------------------------------------------
    def hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks of the first num_tokens tokens, extending the request's own."""
        num_blocks = num_tokens // self.block_size
        if len(request.block_hashes) < num_blocks:
            tokens = list(request.tokens(0, num_blocks * self.block_size))
            request.block_hashes = chain_hashes(tokens, self.block_size, self.fingerprint, request.block_hashes)
        return request.block_hashes[:num_blocks]

    def usable_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the blocks a hit may cover: full blocks, leaving >= 1 token to compute."""
        return self.hashes(request, request.num_tokens - 1)

    def start_fetch(self, request: Request) -> Future[list[FetchedBlock]] | None:
        """Asks the shared tier for blocks beyond the local hit; None when there is nothing to ask."""
        if self.shared is None:
            return None
        wanted = self.usable_hashes(request)
        local = sum(1 for _ in _leading(wanted, self.local))
        if local >= len(wanted):
            return None
        return self.shared.fetch_prefix(wanted, local, request.trace_context)

    def import_fetched(self, blocks: list[FetchedBlock]) -> None:
        """Writes fetched blocks into the local tier (stops at the first that does not fit)."""
        self.on_lookup("shared", bool(blocks))
        pages_per_block = self.block_size // self.runner.kv_page_size_tokens
        for block in blocks:
            if self.local.has_checkpoint(block.block_hash) or (
                block.block_hash in self.local and not block.checkpoint.has_state
            ):
                continue
            self.local.evict_for_pages(pages_per_block)
            checkpoint_id = self.local.allocate_checkpoint() if block.checkpoint.has_state else None
            if (block.checkpoint.has_state and checkpoint_id is None) or not self.runner.kv_pool.can_allocate(
                pages_per_block
            ):
                if checkpoint_id is not None:
                    self.runner.state_pool.free_checkpoint(checkpoint_id)
                return
            page_ids = self.runner.kv_pool.allocate(pages_per_block)
            import_block(self.runner, block.checkpoint, page_ids, checkpoint_id)
            self.local.insert(block.block_hash, block.parent_hash, page_ids, checkpoint_id)
            self.runner.kv_pool.free(page_ids)  # the cache now holds the only reference
            self.num_shared_hits += 1

    def attach(self, request: Request) -> None:
        """Applies the local hit to a request being queued (fresh or preempted)."""
        hit = self.local.acquire(self.usable_hashes(request))
        self.on_lookup("worker", hit is not None)
        if hit is None:
            return
        request.page_ids = hit.page_ids
        self.runner.kv_pool.share(request.page_ids)
        request.num_computed_tokens = hit.num_blocks * self.block_size
        cached = min(request.num_computed_tokens, len(request.prompt_token_ids))
        request.num_cached_tokens = max(request.num_cached_tokens, cached)
        self._hits[request.request_id] = hit

    def on_admit(self, request: Request) -> None:
        """Restores the hit's state into the request's fresh slot and unpins the entries."""
        hit = self._hits.pop(request.request_id, None)
        if hit is not None and request.state_slot is not None:
            self.runner.state_pool.restore_checkpoint(hit.checkpoint_id, request.state_slot)
            self.local.release(hit)

    def on_release(self, request: Request) -> None:
        """The request left before admission (abort, failure): unpin its hit."""
        hit = self._hits.pop(request.request_id, None)
        if hit is not None:
            self.local.release(hit)

    # ---- checkpoints while serving ------------------------------------------------------------------
    def checkpoint_for(self, request: Request, end: int) -> PendingCheckpoint | None:
        """A checkpoint slot for the block ending at `end` (on the grid) unless it is cached."""
        block_index = end // self.block_size - 1
        if block_index < 0 or self.local.has_checkpoint(self.hashes(request, end)[block_index]):
            return None
        checkpoint_id = self.local.allocate_checkpoint()
        if checkpoint_id is None:
            return None
        return PendingCheckpoint(request, block_index, checkpoint_id)

    def register(self, pending: list[PendingCheckpoint]) -> None:
        """After the forward: every full block up to the checkpoint becomes a cache entry (the inner
        ones KV-only), and new ones go to the shared tier."""
        pages_per_block = self.block_size // self.runner.kv_page_size_tokens
        for p in pending:
            hashes = p.request.block_hashes
            for index in range(p.block_index + 1):
                checkpoint_id = p.checkpoint_id if index == p.block_index else None
                if checkpoint_id is None and hashes[index] in self.local:
                    continue
                page_ids = p.request.page_ids[index * pages_per_block : (index + 1) * pages_per_block]
                parent = hashes[index - 1] if index else b""
                fresh = (
                    not self.local.has_checkpoint(hashes[index]) if checkpoint_id else hashes[index] not in self.local
                )
                self.local.insert(hashes[index], parent, page_ids, checkpoint_id)
                if fresh and self.shared is not None:
                    self.shared.publish(hashes[index], parent, export_block(self.runner, page_ids, checkpoint_id))

    def discard(self, pending: list[PendingCheckpoint]) -> None:
        for p in pending:
            self.runner.state_pool.free_checkpoint(p.checkpoint_id)

    # ---- capacity ---------------------------------------------------------------------------------
    def num_free_pages(self, enough: int) -> int:
        """Free pages plus those that evicting unused cached blocks would free. Counting the latter
        walks every entry, so it is skipped when the pool already holds `enough` (more than one step
        can take): then the count cannot change the plan."""
        free = self.runner.kv_pool.num_free_pages
        return free if free >= enough else free + self.local.reclaimable_pages()

    def make_room(self, num_pages: int) -> None:
        self.local.evict_for_pages(num_pages)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()


def _leading(hashes: list[bytes], local: LocalPrefixCache):  # type: ignore[no-untyped-def]
    for h in hashes:
        if h not in local:
            return
        yield h
