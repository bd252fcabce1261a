"""Step 2 of the engine loop: a plan turned into the batch's rows (gpu_worker.engine.prepared), with
the preemptions, admissions and page allocations it asks for. The engine thread alone calls it; the
table moves requests between queues, the allocator gives and takes pages and slots."""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpu_worker.engine.allocator import Allocator
from gpu_worker.engine.prepared import PreparedStep, Row, make_row
from gpu_worker.engine.request import Request
from gpu_worker.engine.table import RequestTable
from scheduler_svc.core import StepPlan

log = logging.getLogger("hybridserve.engine")


def prepare_step(
    plan: StepPlan, table: RequestTable, allocator: Allocator, block_size: int, enqueue: Callable[[Request], None]
) -> PreparedStep:
    """Preempts, admits and allocates what the plan asks; a slice whose request ended since it was
    planned (async scheduling) or that found no pages is skipped. Preempted requests are queued again
    (`enqueue`) only after the step's pages are taken: queueing attaches a request's cached prefix,
    which would pin again the pages its preemption freed for this step's plan. `block_size` is the
    prefix cache's checkpoint grid."""
    requeue = [r for rid in plan.preempted_request_ids if (r := preempt(table, allocator, rid)) is not None]
    rows: list[Row] = []
    running, page_size = table.running, allocator.kv_pool.page_size_tokens
    checkpoints_for = allocator.checkpoints_for
    for planned in plan.slices:  # every row of every step: attribute reads kept in locals
        request = running.get(planned.request_id) or admit(table, allocator, planned.request_id)
        if request is None:
            continue
        start = request.num_computed_tokens
        end = start + planned.num_tokens
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        if end > num_tokens:
            continue
        covered = end <= len(request.page_ids) * page_size  # most decodes: no new page, no call
        if not covered and not allocator.ensure_pages(request, end):
            log.warning("no KV pages for %s although planned; preempting it", request.request_id)
            preempt(table, allocator, request.request_id)
            requeue.append(request)
            continue
        # Checkpoints sit on the block grid: a chunk that reaches no boundary in (start, end]
        # (most decodes) has none to ask for.
        checkpoints = checkpoints_for(request, start, end) if end // block_size > start // block_size else []
        rows.append(make_row(request, planned, checkpoints, end == num_tokens))
        request.num_computed_tokens = end
    for request in requeue:
        enqueue(request)
    return PreparedStep(tuple(rows), tuple(r.request_id for r in requeue))


def admit(table: RequestTable, allocator: Allocator, request_id: str) -> Request | None:
    """A waiting request into the running queue, with a state slot; None if it is not waiting."""
    request = table.pop_waiting(request_id)
    if request is not None:
        allocator.assign_slot(request)
        table.add_running(request)
    return request


def preempt(table: RequestTable, allocator: Allocator, request_id: str) -> Request | None:
    """Frees a running request to recompute everything it knows; the caller queues it again."""
    request = table.pop_running(request_id)
    if request is not None:
        allocator.release(request)
        request.fold_for_recompute()
    return request
