"""Records built from the engine's mutable state, at the moment each event happens."""

from __future__ import annotations

from gpu_worker.engine.output import Ending
from gpu_worker.engine.prepared import PreparedStep
from gpu_worker.engine.records import RequestFinished, RequestQueued, ServedSlice
from gpu_worker.engine.request import Request


def queued(request: Request) -> RequestQueued:
    p = request.params
    return RequestQueued(
        request_id=request.request_id,
        num_prompt_tokens=len(request.prompt_token_ids),
        max_tokens=p.max_tokens,
        priority=p.priority,
        temperature=p.sampling.temperature,
        top_p=p.sampling.top_p,
        top_k=p.sampling.top_k,
        seed=p.sampling.seed,
        stop=p.stop,
        arrival_time=request.arrival_time,
    )


def finished(ending: Ending, now: float) -> RequestFinished:
    r = ending.request
    return RequestFinished(
        request_id=r.request_id,
        reason=ending.reason,
        error=ending.error,
        num_prompt_tokens=len(r.prompt_token_ids),
        num_cached_tokens=r.num_cached_tokens,
        num_output_tokens=len(r.output_token_ids),
        arrival_time=r.arrival_time,
        finish_time=now,
    )


def served(prepared: PreparedStep, yielded: bool) -> tuple[ServedSlice, ...]:
    """The rows of a step that ran; `yielded` is False when its forward failed."""
    # In ServedSlice's field order, through tuple.__new__ (its constructor without the Python call):
    # this runs for every row of every step.
    new = tuple.__new__
    return tuple([
        new(ServedSlice, (
            (request := row.request).request_id,
            (planned := row.slice).num_tokens,
            planned.is_prefill,
            planned.ends_on_checkpoint,
            row.yields and yielded,
            len(request.output_token_ids),
        ))
        for row in prepared.rows
    ])  # fmt: skip
