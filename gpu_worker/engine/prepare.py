"""Step 2 of the engine loop: a plan turned into runner input, the rows of the batch and what each
row means (`PreparedStep`, `Row`), with the dropped prefix hits, preemptions, admissions and page
allocations it asks for. It applies what the plan decided and decides nothing: the planner already
counted the pages each of these frees or takes. The engine thread alone calls it; the table moves
requests between queues, the allocator gives and takes pages and slots."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

from gpu_worker.cache.interface import PendingCheckpoint
from gpu_worker.engine.allocator import Allocator
from gpu_worker.engine.grammar import StepMasks
from gpu_worker.engine.request import Request
from gpu_worker.engine.speculation import Speculator
from gpu_worker.engine.table import RequestTable
from gpu_worker.runner.protocol import Batch, SequenceChunk, StepSampling
from scheduler_svc.core import Slice, StepPlan


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


def make_row(
    request: Request, planned: Slice, checkpoints: list[PendingCheckpoint], yields: bool, drafts: tuple[int, ...] = (),
    mtp: int = -1,
) -> Row:  # fmt: skip
    """The row of `planned` for a request whose pages already cover the chunk; `yields`: the chunk
    ends at the last known token. A checkpoint at the chunk's end is copied from the state slot
    after the forward; those inside it, by the mixers. `drafts`: a decode's draft tokens, after its
    newest token (gpu_worker.engine.speculation). `mtp`: SequenceChunk.mtp_drafts of a yielding row (the
    MTP head; a row that does not yield asks none, and names the token after its chunk)."""
    # Positional construction: this runs for every row of every step.
    start = request.num_computed_tokens
    end = start + planned.num_tokens - len(drafts)
    slot = request.state_slot
    at_end = None
    inside: tuple[tuple[int, int], ...] = ()
    if checkpoints:
        at_end = next((c.checkpoint_id for c in checkpoints if c.position == end), None)
        inside = tuple((c.position, c.checkpoint_id) for c in checkpoints if c.position != end)
    # A request that scores its prompt does it in every chunk until its first token: the chunk's tokens
    # after its first, and the prompt token after it when there is one.
    score, next_token = False, -1
    if request.scoring:
        prompt = request.prompt_token_ids
        score, next_token = start < len(prompt), prompt[end] if end < len(prompt) else -1
    if mtp >= 0 and not yields:
        mtp, next_token = 0, request.tokens(end, end + 1)[0]
    # tuple.__new__(cls, fields) is cls(*fields) without the NamedTuple's Python constructor.
    chunk = _new(SequenceChunk, (
        request.tokens(start, end) + drafts if drafts else request.tokens(start, end),
        start,
        request.page_table(),
        slot if slot is not None else -1,
        at_end,
        inside,
        score,
        next_token,
        len(drafts),
        mtp,
    ))  # fmt: skip
    return _new(Row, (request, planned, chunk, yields, tuple(checkpoints) if checkpoints else ()))


log = logging.getLogger("hybridserve.engine")


def prepare_step(
    plan: StepPlan,
    table: RequestTable,
    allocator: Allocator,
    block_size: int,
    enqueue: Callable[[Request], None],
    speculator: Speculator | None = None,
) -> PreparedStep:
    """Drops the prefix hits, preempts, admits and allocates what the plan asks, in that order (the
    drops' pages are unused cache before anything allocates); a slice whose request ended since it
    was planned (async scheduling) or that found no pages is skipped. Preempted requests are queued
    again (`enqueue`) only after the step's pages are taken: queueing attaches a request's cached
    prefix, which would pin again the pages its preemption freed for this step's plan. `block_size`
    is the prefix cache's checkpoint grid. The plan's failures are the engine's to apply. A decode
    slice of more than one token carries drafts (`speculator`; see `_drafted_row`)."""
    for rid in plan.dropped_prefix_request_ids:
        drop_prefix(table, allocator, rid)
    requeue = [r for rid in plan.preempted_request_ids if (r := preempt(table, allocator, rid)) is not None]
    rows: list[Row] = []
    running, page_size = table.running, allocator.kv_pool.page_size_tokens
    checkpoints_for = allocator.checkpoints_for
    heads = speculator is not None and speculator.mtp  # the MTP head proposes each yielding row's drafts
    for planned in plan.slices:  # every row of every step: attribute reads kept in locals
        request = running.get(planned.request_id) or admit(table, allocator, planned.request_id)
        if request is None:
            continue
        mtp = speculator.head_drafts(request, len(running)) if heads else -1  # type: ignore[union-attr]
        start = request.num_computed_tokens
        end = start + planned.num_tokens
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        if end > num_tokens:
            if speculator is None or start != num_tokens - 1:
                continue
            # a decode granted drafts: a row with those it has, else a plain decode
            row = _drafted_row(request, planned, speculator, allocator, block_size, mtp)
            if row is not None:
                rows.append(row)
                request.num_computed_tokens = start + 1  # its drafts count rejected until verified
                continue
            planned, end = planned._replace(num_tokens=1), num_tokens
        covered = end <= len(request.page_ids) * page_size  # most decodes: no new page, no call
        if not covered and not allocator.ensure_pages(request, end):
            log.warning("no KV pages for %s although planned; preempting it", request.request_id)
            preempt(table, allocator, request.request_id)
            requeue.append(request)
            continue
        # Checkpoints sit on the block grid: a chunk that reaches no boundary in (start, end]
        # (most decodes) has none to ask for.
        checkpoints = checkpoints_for(request, start, end) if end // block_size > start // block_size else []
        rows.append(make_row(request, planned, checkpoints, end == num_tokens, (), mtp))
        request.num_computed_tokens = end
    if heads:
        _chain_room(rows, allocator, speculator.k)  # type: ignore[union-attr]
    for request in requeue:
        enqueue(request)
    return PreparedStep(tuple(rows), tuple(r.request_id for r in requeue))


def _chain_room(rows: list[Row], allocator: Allocator, k: int) -> None:
    """Pages for the MTP head's chained drafts past each drafting row's chunk (gpu_worker.runner.mtp), from
    the pages the step left free (no row of the plan goes short, no cached block is evicted); a row that
    gets none drafts as far as its pages reach."""
    pool = allocator.kv_pool
    for i, row in enumerate(rows):
        chunk, request = row.chunk, row.request
        if chunk.mtp_drafts < 2:
            continue
        upto = min(
            chunk.start_pos + len(chunk.token_ids) + k - 1, len(request.prompt_token_ids) + request.params.max_tokens
        )
        need = pool.pages_for_tokens(upto) - len(request.page_ids)
        if need <= 0 or not pool.can_allocate(need):
            continue
        request.page_ids.extend(pool.allocate(need))
        rows[i] = row._replace(chunk=chunk._replace(page_ids=request.page_table()))


def _drafted_row(
    request: Request, planned: Slice, speculator: Speculator, allocator: Allocator, block_size: int, mtp: int = -1
) -> Row | None:
    """The row of a decode with drafts (its newest token, then those proposed now, at most the plan's
    grant, short of a block boundary the prefix cache checkpoints at), or None when it has none to
    carry or no pages for them: it then runs as a plain decode, the caller's to make."""
    start = request.num_computed_tokens
    checkpoint_at = (start // block_size + 1) * block_size if allocator.checkpoints else None
    drafts = speculator.drafts_for(request, planned.num_tokens - 1, checkpoint_at)
    if not drafts:
        return None
    end = start + 1 + len(drafts)
    if end > len(request.page_ids) * allocator.kv_pool.page_size_tokens and not allocator.ensure_pages(request, end):
        return None
    return make_row(request, planned._replace(num_tokens=1 + len(drafts)), [], True, drafts, mtp)


def admit(table: RequestTable, allocator: Allocator, request_id: str) -> Request | None:
    """A waiting request into the running queue, with a state slot; None if it is not waiting."""
    request = table.pop_waiting(request_id)
    if request is not None:
        allocator.assign_slot(request)
        table.add_running(request)
    return request


def drop_prefix(table: RequestTable, allocator: Allocator, request_id: str) -> None:
    """A waiting request gives up its prefix-cache hit and stays waiting, to compute its whole
    prompt; nothing happens if it is not waiting any more (it ended since the plan was made)."""
    request = table.waiting.get(request_id)
    if request is not None:
        log.info("dropping the prefix-cache hit of waiting request %s, as planned", request_id)
        allocator.drop_prefix(request)


def preempt(table: RequestTable, allocator: Allocator, request_id: str) -> Request | None:
    """Frees a running request to recompute everything it knows; the caller queues it again."""
    request = table.pop_running(request_id)
    if request is not None:
        allocator.release(request)
        request.fold_for_recompute()
    return request


def step_sampling(prepared: PreparedStep, table: RequestTable, words: int) -> StepSampling:
    """What the step samples: every yielding row, the params of those that need more than the argmax, and
    the token masks (`words` 32-bit words a row) of those a grammar constrains, which the runner's call
    builds while the forward runs. A step where no running request samples or is constrained costs no
    Python per row."""
    rows = prepared.yielding_rows
    if not rows or not (table.num_running_sampled or table.num_running_constrained):
        return StepSampling(rows)
    requests = prepared.yielding
    special = [i for i, r in enumerate(requests) if not r.params.sampling.is_plain]
    params = [requests[i].params.sampling for i in special]
    histories: list[tuple[list[int], list[int]] | None] = []
    if any(p.needs_history for p in params):
        histories = [requests[i].history if p.needs_history else None for i, p in zip(special, params, strict=True)]
    if not table.num_running_constrained:
        return StepSampling(rows, special, params, histories=histories)
    masked = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not masked:
        return StepSampling(rows, special, params, histories=histories)
    constraints = [g for i in masked if (g := requests[i].grammar) is not None]
    chunks = [prepared.rows[rows[i]].chunk for i in masked]
    drafts = [c.token_ids[1:] if c.num_draft_tokens else () for c in chunks]  # a verify row: its newest, drafts
    outputs = [requests[i].output_token_ids for i in masked]
    masks = StepMasks(constraints, outputs, words, drafts if any(drafts) else ())
    return StepSampling(rows, special, params, masked, masks, histories)
