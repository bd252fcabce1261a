"""The worker's local prefix-cache tier.

An entry is one full block: the KV pages holding its tokens and a state checkpoint taken at its end
boundary (every boundary a chunk reaches is checkpointed; an entry is KV-only when no checkpoint
slot was free or its checkpoint was taken for a newer block). The cache holds one reference on each page
(KVPagePool.share) and owns the checkpoint slots. A hit of k blocks needs the entries of blocks
0..k-1, the last of them with a checkpoint: their pages give the KV of the whole prefix, the
checkpoint the Mamba state there. KV without the matching state is a miss.

Lifetimes. Requests that will use a hit pin the entries (`acquire`) until their state slot has been
restored (`release`); pinned entries are never evicted. Unpinned entries are evicted least recently
used first when pages or checkpoint slots run short; evicting drops the cache's page references, so
pages still used by a running request stay until it frees them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gpu_worker.runner.protocol import KVPagePool, MambaStatePool

MAX_EVICTED_REMEMBERED = 1 << 16  # block hashes whose entry or state was evicted, for miss reasons


@dataclass(slots=True)
class CacheEntry:
    block_hash: bytes
    parent_hash: bytes
    page_ids: list[int]  # the block's KV pages, in order
    checkpoint_id: int | None  # state at the block's end boundary; None when not kept (KV-only)
    pins: int = 0  # requests waiting to restore from it


@dataclass(frozen=True, slots=True)
class Hit:
    entries: tuple[CacheEntry, ...]  # blocks 0..k-1, pinned

    @property
    def num_blocks(self) -> int:
        return len(self.entries)

    @property
    def page_ids(self) -> list[int]:
        return [p for e in self.entries for p in e.page_ids]

    @property
    def checkpoint_id(self) -> int:
        checkpoint_id = self.entries[-1].checkpoint_id
        assert checkpoint_id is not None  # acquire() ends every hit on a checkpoint
        return checkpoint_id


class LocalPrefixCache:
    def __init__(self, kv_pool: KVPagePool, state_pool: MambaStatePool) -> None:
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self._entries: OrderedDict[bytes, CacheEntry] = OrderedDict()  # least recently used first
        self._evicted: OrderedDict[bytes, None] = OrderedDict()  # evicted entries or states, newest last

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def acquire(self, block_hashes: list[bytes]) -> Hit | None:
        """Pins and returns the longest run of leading blocks present that ends on a block with a
        checkpoint, or None on a miss."""
        found: list[CacheEntry] = []
        usable = 0
        for h in block_hashes:
            entry = self._entries.get(h)
            if entry is None:
                break
            found.append(entry)
            if entry.checkpoint_id is not None:
                usable = len(found)
        found = found[:usable]
        if not found:
            return None
        for entry in found:
            entry.pins += 1
            self._entries.move_to_end(entry.block_hash)
        return Hit(tuple(found))

    def num_leading(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks have an entry (with or without state)."""
        count = 0
        for h in block_hashes:
            if h not in self._entries:
                break
            count += 1
        return count

    def was_evicted(self, block_hash: bytes) -> bool:
        """Whether this block's entry or its state was evicted (and not cached again since)."""
        return block_hash in self._evicted and not self.has_checkpoint(block_hash)

    def _remember_eviction(self, block_hash: bytes) -> None:
        self._evicted[block_hash] = None
        self._evicted.move_to_end(block_hash)
        if len(self._evicted) > MAX_EVICTED_REMEMBERED:
            self._evicted.popitem(last=False)

    def release(self, hit: Hit) -> None:
        for entry in hit.entries:
            entry.pins -= 1

    def has_checkpoint(self, block_hash: bytes) -> bool:
        entry = self._entries.get(block_hash)
        return entry is not None and entry.checkpoint_id is not None

    def insert(self, block_hash: bytes, parent_hash: bytes, page_ids: list[int], checkpoint_id: int | None) -> None:
        """Registers a block; takes a reference on its pages and ownership of the checkpoint slot."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            if entry.checkpoint_id is None:
                entry.checkpoint_id = checkpoint_id
            elif checkpoint_id is not None:
                self.state_pool.free_checkpoint(checkpoint_id)
            return
        self.kv_pool.share(page_ids)
        self._entries[block_hash] = CacheEntry(block_hash, parent_hash, list(page_ids), checkpoint_id)

    def reclaimable_pages(self) -> int:
        """Pages that evicting unpinned entries would return to the free pool."""
        return sum(
            1 for e in self._entries.values() if e.pins == 0 for p in e.page_ids if self.kv_pool.ref_count(p) == 1
        )

    def pinned_alone(self, hit: Hit) -> int:
        """Pages of a pinned hit that releasing it would make reclaimable: its entries are pinned by
        no one else and no request shares the pages (the entry's reference and the hit's)."""
        ref_count = self.kv_pool.ref_count
        return sum(1 for e in hit.entries if e.pins == 1 for p in e.page_ids if ref_count(p) == 2)

    def evict_for_pages(self, num_pages: int) -> None:
        """Evicts LRU unpinned entries until num_pages pages are free (or nothing is left)."""
        for entry in list(self._entries.values()):
            if self.kv_pool.num_free_pages >= num_pages:
                return
            if entry.pins == 0 and any(self.kv_pool.ref_count(p) == 1 for p in entry.page_ids):
                self._evict(entry)

    def allocate_checkpoint(self) -> int | None:
        """A free checkpoint slot, taken from the LRU unpinned entry that has one if needed (the
        entry stays, KV-only); None if every checkpoint is pinned."""
        if self.state_pool.num_free_checkpoints == 0:
            victim = next((e for e in self._entries.values() if e.pins == 0 and e.checkpoint_id is not None), None)
            if victim is None or victim.checkpoint_id is None:
                return None
            self.state_pool.free_checkpoint(victim.checkpoint_id)
            victim.checkpoint_id = None
            self._remember_eviction(victim.block_hash)
        return self.state_pool.allocate_checkpoint()

    def _evict(self, entry: CacheEntry) -> None:
        del self._entries[entry.block_hash]
        self._remember_eviction(entry.block_hash)
        self.kv_pool.free(entry.page_ids)
        if entry.checkpoint_id is not None:
            self.state_pool.free_checkpoint(entry.checkpoint_id)
