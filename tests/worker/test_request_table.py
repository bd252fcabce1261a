"""The request table's deadlines: a step asks for the live requests whose deadline passed, in any
queue, each once; an ended request is never reported, nor a later request that reuses its id."""

from __future__ import annotations

from concurrent.futures import Future

from gpu_worker.engine.request import GenerationParams, Request, StopChecker
from gpu_worker.engine.table import RequestTable
from gpu_worker.runner.sampling import SamplingParams


def make(rid: str, deadline: float | None, sampling: SamplingParams | None = None) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=[5, 6], params=GenerationParams(sampling or SamplingParams(), 4),
        arrival_time=0.0, deadline=deadline, stop_checker=StopChecker(None, ()),
    )  # fmt: skip


def test_passed_deadlines_in_every_queue_earliest_first_each_once() -> None:
    table = RequestTable()
    running, waiting, fetching = make("a", 3.0), make("b", 1.0), make("c", 2.0)
    none, later = make("d", None), make("e", 9.0)
    for r in (running, waiting, fetching, none, later):
        table.watch_deadline(r)
    table.add_running(running)
    table.add_waiting(waiting)
    table.add_waiting(none)
    table.add_waiting(later)
    table.add_fetching(fetching, Future())
    assert table.late(0.5) == []
    assert table.late(5.0) == [waiting, fetching, running]
    assert table.late(5.0) == []  # each once
    assert table.late(10.0) == [later]


def test_an_ended_request_and_a_reused_id_are_not_reported() -> None:
    table = RequestTable()
    first = make("a", 1.0)
    table.watch_deadline(first)
    table.add_running(first)
    assert table.pop_live("a") is first  # it ended before its deadline
    again = make("a", 8.0)  # a new request with the same id
    table.watch_deadline(again)
    table.add_waiting(again)
    assert table.late(2.0) == []  # the first one's entry does not expire the second
    assert table.late(9.0) == [again]


def test_running_requests_that_sample_are_counted_through_every_exit() -> None:
    table = RequestTable()
    sampled = [make(f"s{i}", None, SamplingParams(temperature=0.7)) for i in range(3)]
    with_top = make("t", None, SamplingParams(num_logprobs=2))
    plain = make("p", None)
    for r in (*sampled, with_top, plain):
        table.add_running(r)
    assert table.num_running_sampled == 4
    table.pop_running("s0")  # preempted
    table.pop_live("s1")  # ended
    table.pop_live("p")
    assert table.num_running_sampled == 2
    table.add_waiting(sampled[0])  # waiting requests are not counted
    assert table.num_running_sampled == 2
    table.pop_live("s2")
    table.pop_live("t")
    assert table.num_running_sampled == 0
