"""Records built from the engine's mutable state, at the moment each event happens."""

from __future__ import annotations

from itertools import repeat
from operator import add, attrgetter, itemgetter

from gpu_worker.engine.output import Ending
from gpu_worker.engine.prepared import PreparedStep, Row
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
    # A ServedSlice is the row's Slice (its first four fields) plus (sampled, num_output_tokens),
    # built through tuple.__new__ in C loops over the rows: this runs for every row of every step.
    rows = prepared.rows
    sampled = map(_YIELDS, rows) if yielded else repeat(False, len(rows))
    num_outputs = map(len, map(_OUTPUT_TOKEN_IDS, map(_REQUEST, rows)))
    tails = zip(sampled, num_outputs, strict=True)
    return tuple(map(tuple.__new__, repeat(ServedSlice), map(add, map(_SLICE, rows), tails)))


_REQUEST, _SLICE, _YIELDS = (itemgetter(Row._fields.index(f)) for f in ("request", "slice", "yields"))
_OUTPUT_TOKEN_IDS = attrgetter("output_token_ids")
