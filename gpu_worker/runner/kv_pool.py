"""The paged KV cache: a preallocated pool of fixed-size pages for every attention layer.

Lifetimes. A page id is valid from `allocate` until its reference count drops to zero through `free`.
A request holds one reference to each page of its page table; the prefix cache takes extra references
with `share` so a page outlives the request that wrote it. Pages are only ever written at positions a
request computes itself, so a shared (full, cached) page is read-only in practice. The tensors are
created once and never reallocated, so views of them stay valid for the pool's lifetime."""

from __future__ import annotations

import torch

from gpu_worker.runner.shared_memory import Allocator
from hybridserve.errors import InvalidArgumentError, ResourceExhaustedError


class KVPagePool:
    """Page allocator plus the K/V storage of every attention layer.

    Storage per attention layer: k and v of shape [num_pages * page_size, kv_heads, head_dim]; the flat
    slot of position p of a request is page_table[p // page_size] * page_size + p % page_size."""

    def __init__(
        self,
        num_pages: int,
        page_size_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        alloc: Allocator | None = None,
    ) -> None:
        """`alloc` makes the storage (zeros; default torch.zeros on `device`): a shared arena when another
        process runs the model over the same pages (gpu_worker.runner.model_process)."""
        if num_pages <= 0 or page_size_tokens <= 0:
            raise InvalidArgumentError(
                f"KV pool needs positive pages and page size, got {num_pages}, {page_size_tokens}"
            )
        self.num_pages = num_pages
        self.page_size_tokens = page_size_tokens
        # [layer, k|v, slot, kv_head, head_dim]
        shape = (num_layers, 2, num_pages * page_size_tokens, num_kv_heads, head_dim)
        self._storage = alloc(shape, dtype) if alloc else torch.zeros(shape, dtype=dtype, device=device)
        self._ref_counts = [0] * num_pages
        self._free_ids = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K+V bytes one token occupies across all attention layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(k, v) views per attention layer, in layer order."""
        return [(self._storage[i, 0], self._storage[i, 1]) for i in range(self._storage.shape[0])]

    @property
    def num_free_pages(self) -> int:
        return len(self._free_ids)

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` positions."""
        return -(-num_tokens // self.page_size_tokens)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free_ids)

    def allocate(self, num_pages: int) -> list[int]:
        """Take `num_pages` free pages (reference count 1 each). Contents are stale, not zeroed."""
        if not self.can_allocate(num_pages):
            raise ResourceExhaustedError(f"KV pool: {num_pages} pages requested, {len(self._free_ids)} free")
        page_ids = [self._free_ids.pop() for _ in range(num_pages)]
        for p in page_ids:
            self._ref_counts[p] = 1
        return page_ids

    def share(self, page_ids: list[int]) -> None:
        """Take one more reference on pages already held by someone."""
        for p in page_ids:
            if self._ref_counts[p] <= 0:
                raise InvalidArgumentError(f"KV pool: cannot share page {p}, it is not allocated")
            self._ref_counts[p] += 1

    def free(self, page_ids: list[int]) -> None:
        """Drop one reference per page; a page returns to the free list at zero. Freed pages go back so
        that the next `allocate` hands them out in the order they were held: a page table of consecutive
        pages comes back consecutive and ascending, and a long sequence's decode attention reads such
        pages in place (`decode_attention.split_decode_attention`) instead of gathering them (2,000 keys:
        85 against 281 us a layer). Handed out highest first, as a stack would, they never were."""
        released = []
        try:
            for p in page_ids:
                if self._ref_counts[p] <= 0:
                    raise InvalidArgumentError(f"KV pool: page {p} freed more often than allocated")
                self._ref_counts[p] -= 1
                if self._ref_counts[p] == 0:
                    released.append(p)
        finally:  # pages released before a bad id are free all the same
            self._free_ids.extend(reversed(released))

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]
