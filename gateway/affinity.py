"""Which worker was last sent each prefix block: a bounded LRU map from block hash to one worker.

The gateway cannot see the workers' caches; it remembers where it last sent each prompt's leading
blocks and assumes they are cached there. One owner per block, not every worker that ever got it:
when load moves a prefix to another worker, the prefix moves with it, so each prefix is counted on
(and kept warm by) one worker and the workers' caches add up instead of holding the same prefixes
(the older copy ages out of its worker's LRU). A worker that goes down is forgotten entirely (its
cache does not survive a restart). Not thread-safe: the gateway touches it from its event loop only."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_MAX_ENTRIES = 200_000  # block hashes remembered (about 100 bytes each)


class PrefixTable:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._owner: OrderedDict[int, str] = OrderedDict()  # block hash -> worker address
        self._max_entries = max_entries

    def __len__(self) -> int:
        return len(self._owner)

    def num_matched_blocks(self, block_hashes: Sequence[int], address: str) -> int:
        """How many leading blocks of the prompt were last sent to `address` (a run from block 0)."""
        matched = 0
        for block_hash in block_hashes:
            if self._owner.get(block_hash) != address:
                break
            matched += 1
        return matched

    def record(self, block_hashes: Sequence[int], address: str) -> None:
        """The prompt's blocks were sent to `address`: it owns them now."""
        for block_hash in block_hashes:
            self._owner[block_hash] = address
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self._max_entries:
            self._owner.popitem(last=False)

    def forget(self, address: str) -> None:
        """The worker lost its cache (it went down): drop the blocks it owned."""
        for block_hash in [h for h, owner in self._owner.items() if owner == address]:
            del self._owner[block_hash]
