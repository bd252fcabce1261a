"""The penalties' and min_tokens' per-request state, which outlives a step: each state slot's distinct seen
tokens, their generated counts and its number of generated tokens (`HistoryTables`), written by a
`HistoryWriter` from the engine's token lists: once when a request first samples in its slot, then the new
tokens of each step. The tables live where every model process can read them (the worker's shared arena),
since a request's row may move between processes from step to step; sampling (gpu_worker.runner.sampling)
reads them with `HistoryTables.rows`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gpu_worker.runner.batch import Batch
from gpu_worker.runner.shared_memory import Allocator
from hybridserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from gpu_worker.runner.sampling import SamplingParams, StepSampling

# A request's tokens as the engine holds them (prompt, generated), shared, not copied: what a HistoryWriter
# reads of each row that needs_history.
TokenHistory = tuple[Sequence[int], Sequence[int]]


def history_capacity(vocab: int, num_pages: int, page_size: int) -> int:
    """The most distinct tokens one request can have seen: the vocabulary, or the KV pool's tokens."""
    return max(1, min(vocab, num_pages * page_size))


class HistoryTables:
    """Per state slot, what the penalties and min_tokens read of the request in the slot, sparse: the
    distinct tokens it has seen (`ids`, the first `num_unique`: its generated tokens, and its prompt's
    when it has a repetition_penalty), how often it generated each (`counts`), and how many tokens it
    generated (`num_outputs`). A step's penalties gather and scatter the logits at those ids only: the
    cost follows the tokens seen, not the vocabulary. `capacity` bounds the distinct tokens of one
    request (the vocabulary, or the most tokens a request can hold, whichever is less). Built over an
    `Allocator` (the worker's shared arena, attached in the same order by its model processes; in
    process, torch.zeros): large zero allocations are mapped lazily, so only slots that held a request
    with penalties take memory."""

    def __init__(self, num_slots: int, capacity: int, alloc: Allocator) -> None:
        self.num_slots = num_slots
        self.capacity = capacity
        self.ids = alloc((num_slots, capacity), torch.int32)
        self.counts = alloc((num_slots, capacity), torch.int32)
        self.num_unique = alloc((num_slots,), torch.int64)
        self.num_outputs = alloc((num_slots,), torch.int64)
        self._ids, self._counts = self.ids.numpy(), self.counts.numpy()
        self._unique, self._num = self.num_unique.numpy(), self.num_outputs.numpy()

    def rows(self, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """(ids [k, u] int64, generated counts [k, u] float32, valid [k, u] bool, generated) of `slots`,
        u the most distinct tokens among them."""
        index = np.asarray(slots, dtype=np.int64)
        unique = self._unique[index]
        width = max(int(unique.max()), 1)
        ids = torch.from_numpy(self._ids[index, :width].astype(np.int64))
        counts = torch.from_numpy(self._counts[index, :width].astype(np.float32))
        valid = torch.from_numpy(np.arange(width)[None, :] < unique[:, None])
        return ids, counts, valid, self._num[index].tolist()


class HistoryWriter:
    """The engine's side of `HistoryTables`: for each special row whose params need_history, writes the
    request's whole history when it first samples in its slot (its params or its prompt list are not the
    ones the slot holds), then only the tokens generated since (one a decode step: a dictionary look-up
    and one count). A request that comes back to a slot it held (after a preemption) finds its rows as it
    left them, unless another request with penalties wrote there since, in which case its whole history
    is written again."""

    def __init__(self, tables: HistoryTables) -> None:
        self.tables = tables
        self._ids: np.ndarray[Any, Any] = tables.ids.numpy()
        self._counts: np.ndarray[Any, Any] = tables.counts.numpy()
        self._unique: np.ndarray[Any, Any] = tables.num_unique.numpy()
        self._num: np.ndarray[Any, Any] = tables.num_outputs.numpy()
        # whose history each slot holds: the request's params and prompt list (the engine's, one per request)
        self._of: list[tuple[SamplingParams, Sequence[int]] | None] = [None] * tables.num_slots
        self._where: list[dict[int, int]] = [{} for _ in range(tables.num_slots)]  # token -> its column
        self._written = [0] * tables.num_slots  # generated tokens counted in the slot's row
        self.tokens_written = 0  # generated tokens written, all steps (the diffs' size)

    def publish(self, batch: Batch, sampling: StepSampling) -> None:
        if not sampling.histories:
            return
        seqs, rows = batch.sequences, sampling.rows
        for j, params, history in zip(sampling.special, sampling.params, sampling.histories, strict=True):
            if history is None:
                continue
            slot = seqs[rows[j]].state_slot
            prompt, outputs = history
            held = self._of[slot]
            if held is None or held[0] is not params or held[1] is not prompt or len(outputs) < self._written[slot]:
                self._start(slot, params, prompt)
            where, ids, counts = self._where[slot], self._ids[slot], self._counts[slot]
            for token in outputs[self._written[slot] :]:  # a decode step's diff: the token it sampled last
                column = where.get(token)
                if column is None:
                    column = where[token] = len(where)
                    if column >= self.tables.capacity:
                        raise InvalidArgumentError(f"sampling history: more than {self.tables.capacity} tokens")
                    ids[column], counts[column] = token, 0
                counts[column] += 1
            self.tokens_written += len(outputs) - self._written[slot]
            self._written[slot] = len(outputs)
            self._unique[slot] = len(where)
            self._num[slot] = len(outputs)

    def _start(self, slot: int, params: SamplingParams, prompt: Sequence[int]) -> None:
        """A request new to the slot: its prompt's distinct tokens (for repetition_penalty), counted 0."""
        seen: np.ndarray[Any, Any] = (
            np.unique(np.asarray(prompt, dtype=np.int64)) if params.repetition_penalty != 1.0 else np.empty(0, np.int64)
        )
        if len(seen) > self.tables.capacity:
            raise InvalidArgumentError(f"sampling history: more than {self.tables.capacity} tokens")
        self._ids[slot, : len(seen)] = seen
        self._counts[slot, : len(seen)] = 0
        self._where[slot] = dict(zip(seen.tolist(), range(len(seen)), strict=True))
        self._of[slot], self._written[slot] = (params, prompt), 0
        self._unique[slot] = len(seen)
