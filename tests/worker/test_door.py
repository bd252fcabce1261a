"""The door's aborts by request: a call that ended aborts its own request, never a later one that
reused its id, whether the abort comes after the new request was submitted or was queued before."""

from __future__ import annotations

from gpu_worker.engine.door import Door
from gpu_worker.engine.request import FinishReason, GenerationParams, Request, StopChecker
from gpu_worker.runner.sampling import SamplingParams


def make(rid: str) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=[5, 6], params=GenerationParams(SamplingParams(), 4),
        arrival_time=0.0, deadline=None, stop_checker=StopChecker(None, ()),
    )  # fmt: skip


def submitted(door: Door, request: Request) -> Request:
    door.submit(request, 0, lambda r: None)
    return request


def test_an_ended_requests_abort_leaves_the_request_that_reused_its_id() -> None:
    door = Door(max_queue_len=8)
    old = submitted(door, make("same"))
    door.take()
    door.forget(["same"])  # it ended
    new = submitted(door, make("same"))
    assert not door.abort("same", FinishReason.ABORT, only=old)
    assert door.take() == ([new], [])
    assert door.abort("same", FinishReason.ABORT, only=new)
    assert door.take() == ([], [("same", FinishReason.ABORT)])


def test_an_abort_queued_before_the_id_was_reused_is_dropped() -> None:
    door = Door(max_queue_len=8)
    old = submitted(door, make("same"))
    door.take()
    assert door.abort("same", FinishReason.ABORT, only=old)  # queued while `old` is live
    door.forget(["same"])  # `old` ends before the engine thread takes the abort
    new = submitted(door, make("same"))
    assert door.take() == ([new], [])  # the abort was for `old`: `new` runs on


def test_an_abort_by_id_alone_ends_whichever_request_holds_it() -> None:
    door = Door(max_queue_len=8)
    submitted(door, make("id"))
    assert door.abort("id", FinishReason.ABORT)
    assert door.take()[1] == [("id", FinishReason.ABORT)]
    assert not door.abort("nobody", FinishReason.ABORT)
