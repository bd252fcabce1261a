"""A plan turned into runner input: the rows of the batch and what each row means."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

from gpu_worker.batch import Batch, SequenceChunk
from gpu_worker.cache.interface import PendingCheckpoint
from gpu_worker.engine.request import Request
from scheduler_svc.core import Slice


class Row(NamedTuple):
    """One batch row: a request's chunk [start, end) of its known tokens.

    A NamedTuple, immutable like a frozen dataclass: one is built per row every step, and a
    frozen dataclass costs two to four times as much to construct.
    """

    request: Request
    slice: Slice  # as planned
    chunk: SequenceChunk
    yields: bool  # the chunk reaches the end of the known tokens: the step samples the next token
    checkpoints: tuple[PendingCheckpoint, ...]  # states at the block boundaries the chunk reaches


_CHUNK = attrgetter("chunk")


@dataclass(frozen=True, slots=True)
class PreparedStep:
    rows: tuple[Row, ...]  # in batch order
    preempted_request_ids: tuple[str, ...]  # by the plan, then those that found no pages
    # Derived once from rows (sample, apply, the next snapshot and the step record all read them):
    yielding_rows: list[int] = field(init=False)  # batch rows that get a new token, in order
    yielding: list[Request] = field(init=False)  # their requests
    batch: Batch | None = field(init=False)  # the runner's input; None without rows

    def __post_init__(self) -> None:
        rows = self.rows
        indices = [i for i, r in enumerate(rows) if r.yields]
        object.__setattr__(self, "yielding_rows", indices)
        object.__setattr__(self, "yielding", [rows[i].request for i in indices])
        object.__setattr__(self, "batch", Batch(tuple(map(_CHUNK, rows))) if rows else None)

    @property
    def yielding_ids(self) -> set[str]:
        return {r.request_id for r in self.yielding}

    @property
    def checkpoints(self) -> list[PendingCheckpoint]:
        return [c for r in self.rows if r.checkpoints for c in r.checkpoints]


_new = tuple.__new__


def make_row(request: Request, planned: Slice, checkpoints: list[PendingCheckpoint], yields: bool) -> Row:
    """The row of `planned` for a request whose pages already cover the chunk; `yields`: the chunk
    ends at the last known token. A checkpoint at the chunk's end is copied from the state slot
    after the forward; those inside it, by the mixers."""
    # Positional construction: this runs for every row of every step.
    start = request.num_computed_tokens
    end = start + planned.num_tokens
    slot = request.state_slot
    at_end = None
    inside: tuple[tuple[int, int], ...] = ()
    if checkpoints:
        at_end = next((c.checkpoint_id for c in checkpoints if c.position == end), None)
        inside = tuple((c.position, c.checkpoint_id) for c in checkpoints if c.position != end)
    # tuple.__new__(cls, fields) is cls(*fields) without the NamedTuple's Python constructor.
    chunk = _new(SequenceChunk, (
        request.tokens(start, end),
        start,
        request.page_table(),
        slot if slot is not None else -1,
        at_end,
        inside,
    ))  # fmt: skip
    return _new(Row, (request, planned, chunk, yields, tuple(checkpoints) if checkpoints else ()))
