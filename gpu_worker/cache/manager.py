"""Prefix caching as the engine sees it: find a request's cached prefix when it is queued, restore
it when it is admitted, checkpoint every block boundary a chunk reaches, publish new blocks to the
shared tier, and say why each lookup stopped short (gpu_worker/cache/misses.py).

Grid: the scheduler's block_size (checkpoints are taken there: at a chunk's end by copying the
state slot, inside a chunk by the mixers, gpu_worker/model/boundary_states.py); KV pages stay
small. A request with a hit of k blocks is queued with num_computed_tokens = k * block_size, holding references to those
blocks' pages, and its state slot is restored from block k-1's checkpoint when it is admitted. At
least one prompt token is always left to compute, so the step that finishes the prompt yields logits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future

from gpu_worker.cache.blocks import chain_hashes
from gpu_worker.cache.interface import CachedSequence, CacheLookup, CacheStats, PendingCheckpoint, PrefixCache
from gpu_worker.cache.local import Hit, LocalPrefixCache
from gpu_worker.cache.misses import FetchOrRecompute, MissReason
from gpu_worker.cache.remote import FetchedBlock, FetchResult, SharedTier
from gpu_worker.runner.protocol import Pools

log = logging.getLogger("hybridserve.cache")


class PrefixCacheManager(PrefixCache):
    """The local tier in the worker's pools, plus the shared tier when one is configured."""

    def __init__(self, pools: Pools, fingerprint: str, block_size: int, shared: SharedTier | None = None) -> None:
        self.pools = pools
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.local = LocalPrefixCache(pools.kv_pool, pools.state_pool)
        self.shared = shared
        self._hits: dict[str, Hit] = {}  # request_id -> pinned hit awaiting admission
        self._shared_misses: dict[str, MissReason] = {}  # request_id -> why the shared tier gave no more
        self.num_shared_hits = 0
        bytes_per_block = block_size * pools.kv_bytes_per_token + pools.state_bytes_per_request
        self.fetch_policy = FetchOrRecompute(bytes_per_block, block_size)
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_declined_tokens = 0
        self.miss_reasons: dict[str, int] = {}
        self.num_rejected_blocks = 0  # fetched blocks that failed to import (a miss each)

    # ---- queueing ---------------------------------------------------------------------------------
    def hashes(self, seq: CachedSequence, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks of the first num_tokens tokens, extending the request's own."""
        num_blocks = num_tokens // self.block_size
        if len(seq.block_hashes) < num_blocks:
            tokens = list(seq.tokens(0, num_blocks * self.block_size))
            seq.block_hashes = chain_hashes(tokens, self.block_size, self.fingerprint, seq.block_hashes, seq.cache_salt)
        return seq.block_hashes[:num_blocks]

    def usable_hashes(self, seq: CachedSequence) -> list[bytes]:
        """Hashes of the blocks a hit may cover: full blocks, leaving >= 1 token to compute."""
        return self.hashes(seq, seq.num_tokens - 1)

    def start_fetch(self, seq: CachedSequence) -> Future[FetchResult] | None:
        """Asks the shared tier for blocks beyond the local hit; None when there is nothing to ask."""
        if self.shared is None:
            return None
        wanted = self.usable_hashes(seq)
        local = sum(1 for _ in _leading(wanted, self.local))
        if local >= len(wanted):
            return None
        return self.shared.fetch_prefix(seq.request_id, wanted, local, seq.trace_context, self.fetch_policy)

    def import_fetched(self, fetch: Future[FetchResult]) -> CacheLookup | None:
        """Writes a finished fetch's blocks into the local tier and keeps why it gave no more for the
        request's lookup. A failed fetch (the shared tier's own errors are already empty results)
        imports nothing and reports no lookup."""
        if fetch.cancelled() or fetch.exception() is not None:
            return None
        result = fetch.result()
        miss_reason = result.miss_reason
        if not self._import_blocks(result.blocks):
            miss_reason = MissReason.FAILED_VERIFICATION  # the first block not imported is the miss
        if miss_reason is not None:
            self._shared_misses[result.request_id] = miss_reason
        if result.miss_reason is MissReason.FETCH_SLOWER:
            self.num_declined_tokens += result.num_offered_blocks * self.block_size
        reason = miss_reason.value if miss_reason is not None else ""
        return CacheLookup(
            "shared", bool(result.blocks), result.request_id, miss_reason=reason, decision=result.decision
        )

    def _import_blocks(self, blocks: list[FetchedBlock]) -> bool:
        """Stops at the first block that does not fit; False when a block failed its import."""
        pages_per_block = self.block_size // self.pools.kv_page_size_tokens
        for block in blocks:
            if self.local.has_checkpoint(block.block_hash) or (
                block.block_hash in self.local and not block.checkpoint.has_state
            ):
                continue
            self.local.evict_for_pages(pages_per_block)
            checkpoint_id = self.local.allocate_checkpoint() if block.checkpoint.has_state else None
            if (block.checkpoint.has_state and checkpoint_id is None) or not self.pools.kv_pool.can_allocate(
                pages_per_block
            ):
                if checkpoint_id is not None:
                    self.pools.state_pool.free_checkpoint(checkpoint_id)
                return True
            page_ids = self.pools.kv_pool.allocate(pages_per_block)
            if not self._import_one(block, page_ids, checkpoint_id):
                return False
            self.local.insert(block.block_hash, block.parent_hash, page_ids, checkpoint_id)
            self.pools.kv_pool.free(page_ids)  # the cache now holds the only reference
            self.num_shared_hits += 1
        return True

    def _import_one(self, block: FetchedBlock, page_ids: list[int], checkpoint_id: int | None) -> bool:
        """Writes one fetched block into its pages and slot. A block that does not fit this model
        (checkpoint_io raises) is a miss: its pages and slot are freed, nothing is cached, and the
        blocks after it (whose state depends on it) are not imported."""
        try:
            self.pools.import_block(block.checkpoint, page_ids, checkpoint_id)
        except Exception as exc:
            self.pools.kv_pool.free(page_ids)
            if checkpoint_id is not None:
                self.pools.state_pool.free_checkpoint(checkpoint_id)
            self.num_rejected_blocks += 1
            log.warning("fetched block %s does not fit this model (%s: %s); a miss", block.block_hash.hex()[:16],
                        type(exc).__name__, exc)  # fmt: skip
            return False
        return True

    def attach(self, seq: CachedSequence) -> CacheLookup:
        """Applies the local hit to a request being queued (fresh or preempted); the lookup says
        how many tokens it asked and got, and why it stopped short."""
        wanted = self.usable_hashes(seq)
        hit = self.local.acquire(wanted)
        num_blocks = hit.num_blocks if hit is not None else 0
        shared_miss = self._shared_misses.pop(seq.request_id, None)
        reason = self._miss_reason(wanted, num_blocks, shared_miss) if num_blocks < len(wanted) else None
        self.num_query_tokens += len(wanted) * self.block_size
        self.num_hit_tokens += num_blocks * self.block_size
        if reason is not None:
            self.miss_reasons[reason.value] = self.miss_reasons.get(reason.value, 0) + 1
        lookup = CacheLookup(
            "worker", hit is not None, seq.request_id, len(wanted) * self.block_size, num_blocks * self.block_size,
            reason.value if reason is not None else "",
        )  # fmt: skip
        if hit is None:
            return lookup
        seq.page_ids = hit.page_ids
        self.pools.kv_pool.share(seq.page_ids)
        seq.num_computed_tokens = hit.num_blocks * self.block_size
        cached = min(seq.num_computed_tokens, len(seq.prompt_token_ids))
        seq.num_cached_tokens = max(seq.num_cached_tokens, cached)
        self._hits[seq.request_id] = hit
        return lookup

    def _miss_reason(self, wanted: list[bytes], num_hit_blocks: int, shared_miss: MissReason | None) -> MissReason:
        """Why block `num_hit_blocks` of `wanted` is not part of the hit."""
        present = self.local.num_leading(wanted)
        if present > num_hit_blocks:  # KV cached past the hit, but no state at a boundary there
            evicted = any(self.local.was_evicted(h) for h in wanted[num_hit_blocks:present])
            return MissReason.EVICTED if evicted else MissReason.KV_WITHOUT_STATE
        if shared_miss is not None:
            return shared_miss
        return MissReason.EVICTED if self.local.was_evicted(wanted[num_hit_blocks]) else MissReason.NO_ENTRY

    def on_admit(self, seq: CachedSequence) -> None:
        """Restores the hit's state into the request's fresh slot and unpins the entries."""
        hit = self._hits.pop(seq.request_id, None)
        if hit is not None and seq.state_slot is not None:
            self.pools.state_pool.restore_checkpoint(hit.checkpoint_id, seq.state_slot)
            self.local.release(hit)

    def on_release(self, seq: CachedSequence) -> None:
        """The request left before admission (abort, failure): unpin its hit."""
        hit = self._hits.pop(seq.request_id, None)
        if hit is not None:
            self.local.release(hit)

    # ---- checkpoints while serving ------------------------------------------------------------------
    def checkpoints_for(self, seq: CachedSequence, start: int, end: int) -> list[PendingCheckpoint]:
        """Checkpoint slots for every block boundary in (start, end] whose block has no state cached
        yet: the chunk keeps the state at each (the mixers take the inner ones from the scan), so
        every full block becomes a hit point whatever the chunking. The deepest boundaries come
        first when slots run short (a deeper hit saves more); the list is in position order."""
        first, last = start // self.block_size + 1, end // self.block_size
        if last < first:
            return []
        hashes = self.hashes(seq, end)
        pending: list[PendingCheckpoint] = []
        for boundary in range(last, first - 1, -1):
            block_index = boundary - 1
            if self.local.has_checkpoint(hashes[block_index]):
                continue
            checkpoint_id = self.local.allocate_checkpoint()
            if checkpoint_id is None:
                break
            pending.append(PendingCheckpoint(seq, block_index, checkpoint_id, boundary * self.block_size))
        return pending[::-1]

    def register(self, pending: list[PendingCheckpoint]) -> None:
        """After the forward: every full block up to a sequence's last checkpoint becomes a cache
        entry (KV-only where no state was kept), and new ones go to the shared tier."""
        by_seq: dict[int, tuple[CachedSequence, dict[int, int]]] = {}
        for p in pending:
            by_seq.setdefault(id(p.seq), (p.seq, {}))[1][p.block_index] = p.checkpoint_id
        for seq, checkpoints in by_seq.values():
            self._register_blocks(seq, checkpoints)

    def _register_blocks(self, seq: CachedSequence, checkpoints: dict[int, int]) -> None:
        pages_per_block = self.block_size // self.pools.kv_page_size_tokens
        hashes = seq.block_hashes
        for index in range(max(checkpoints) + 1):
            checkpoint_id = checkpoints.get(index)
            if checkpoint_id is None and hashes[index] in self.local:
                continue
            page_ids = seq.page_ids[index * pages_per_block : (index + 1) * pages_per_block]
            parent = hashes[index - 1] if index else b""
            fresh = (
                not self.local.has_checkpoint(hashes[index])
                if checkpoint_id is not None
                else hashes[index] not in self.local
            )
            self.local.insert(hashes[index], parent, page_ids, checkpoint_id)
            if fresh and self.shared is not None:
                self.shared.publish(hashes[index], parent, self.pools.export_block(page_ids, checkpoint_id))

    def discard(self, pending: list[PendingCheckpoint]) -> None:
        """The forward failed: the slots hold nothing."""
        for p in pending:
            self.pools.state_pool.free_checkpoint(p.checkpoint_id)

    def record_forward(self, num_prefill_tokens: int, seconds: float) -> None:
        """Prefill speed for the fetch-or-recompute rule."""
        self.fetch_policy.record_prefill(num_prefill_tokens, seconds)

    def stats(self) -> CacheStats:
        return CacheStats(self.num_query_tokens, self.num_hit_tokens, self.num_declined_tokens, dict(self.miss_reasons))

    # ---- capacity ---------------------------------------------------------------------------------
    def num_free_pages(self, free_pages: int, enough: int) -> int:
        """Free pages plus those that evicting unused cached blocks would free. Counting the latter
        walks every entry, so it is skipped when the pool already holds `enough` (more than one step
        can take): then the count cannot change the plan."""
        return free_pages if free_pages >= enough else free_pages + self.local.reclaimable_pages()

    def num_pinned_pages(self, seq: CachedSequence) -> int:
        """The pages of the sequence's pinned hit that only it and the cache hold."""
        hit = self._hits.get(seq.request_id)
        return self.local.pinned_alone(hit) if hit is not None else 0

    def make_room(self, num_pages: int) -> None:
        """Evicts unpinned cached blocks, least recently used first."""
        self.local.evict_for_pages(num_pages)

    def close(self) -> None:
        """Stops the shared tier's publisher."""
        if self.shared is not None:
            self.shared.close()


def _leading(hashes: list[bytes], local: LocalPrefixCache) -> Iterator[bytes]:
    for h in hashes:
        if h not in local:
            return
        yield h
