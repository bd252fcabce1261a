"""Which worker was last sent each prefix block: a bounded LRU map from block hash to workers.

The gateway cannot see the workers' caches; it remembers where it sent each prompt's leading blocks
and assumes they are still cached there. A worker that goes down is forgotten entirely (its cache
does not survive a restart). Not thread-safe: the gateway touches it from its event loop only."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_MAX_ENTRIES = 200_000  # block hashes remembered (about 100 bytes each)


class PrefixTable:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._workers_of: OrderedDict[int, set[str]] = OrderedDict()
        self._max_entries = max_entries

    def __len__(self) -> int:
        return len(self._workers_of)

    def num_matched_blocks(self, block_hashes: Sequence[int], address: str) -> int:
        """How many leading blocks of the prompt were last sent to `address` (a run from block 0)."""
        matched = 0
        for block_hash in block_hashes:
            workers = self._workers_of.get(block_hash)
            if workers is None or address not in workers:
                break
            matched += 1
        return matched

    def record(self, block_hashes: Sequence[int], address: str) -> None:
        """The prompt's blocks were sent to `address`: it is now assumed to hold them."""
        for block_hash in block_hashes:
            workers = self._workers_of.get(block_hash)
            if workers is None:
                self._workers_of[block_hash] = {address}
            else:
                workers.add(address)
                self._workers_of.move_to_end(block_hash)
        while len(self._workers_of) > self._max_entries:
            self._workers_of.popitem(last=False)

    def forget(self, address: str) -> None:
        """The worker lost its cache (it went down): drop it from every block."""
        for block_hash in list(self._workers_of):
            workers = self._workers_of[block_hash]
            workers.discard(address)
            if not workers:
                del self._workers_of[block_hash]
