"""A Generate stream that fell behind sends the events queued meanwhile as one message: the same
tokens, log-probabilities, alternatives and text in order, the last event's finish reason and usage;
one that keeps up takes nothing extra (no wait), and an error event is raised after what came before."""

from __future__ import annotations

import queue

from gpu_worker.api.service import merge_events, output_to_pb, take_queued
from gpu_worker.engine.request import FinishReason, RequestOutput
from hybridserve.errors import AbortedError
from hybridserve.v1 import generation_pb2 as pb


def token(i: int, top: bool = False) -> RequestOutput:
    alternatives = ((i, -0.5), (i + 1, -1.5)) if top else ()
    return RequestOutput((i,), (-0.1 * i,), (alternatives,), f"<{i}>")


def last(i: int) -> RequestOutput:
    return RequestOutput((i,), (-0.1 * i,), ((),), f"<{i}>", FinishReason.LENGTH, 7, 2, i)


def test_a_stream_that_keeps_up_takes_nothing_more() -> None:
    events: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
    assert take_queued(events, token(1)) == []


def test_queued_events_merge_into_one_message_with_the_same_content() -> None:
    events: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
    for i in (2, 3, 4):
        events.put(token(i, top=True))
    behind = take_queued(events, token(1, top=True))
    assert len(behind) == 3
    merged = output_to_pb("r", merge_events(token(1, top=True), behind))
    singles = [output_to_pb("r", token(i, top=True)) for i in (1, 2, 3, 4)]
    assert list(merged.token_ids) == [t for m in singles for t in m.token_ids] == [1, 2, 3, 4]
    assert list(merged.logprobs) == [lp for m in singles for lp in m.logprobs]
    assert list(merged.top_logprobs) == [top for m in singles for top in m.top_logprobs]
    assert merged.text == "<1><2><3><4>"
    assert merged.finish_reason == pb.FINISH_REASON_UNSPECIFIED


def test_taking_stops_at_the_last_event_which_carries_the_end() -> None:
    events: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
    events.put(token(2))
    events.put(last(3))
    behind = take_queued(events, token(1))
    merged = output_to_pb("r", merge_events(token(1), behind))
    assert list(merged.token_ids) == [1, 2, 3] and merged.text == "<1><2><3>"
    assert not merged.top_logprobs  # no alternatives asked: none sent, as per token
    assert merged.finish_reason == pb.FINISH_REASON_LENGTH
    assert (merged.usage.prompt_tokens, merged.usage.cached_tokens, merged.usage.completion_tokens) == (7, 2, 3)
    assert take_queued(events, last(3)) == []  # nothing follows a last event


def test_an_error_event_ends_the_take_and_is_left_out_of_the_merge() -> None:
    events: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
    failure = RequestOutput(error=AbortedError("model forward failed"))
    events.put(token(2))
    events.put(failure)
    events.put(token(9))  # never reached
    behind = take_queued(events, token(1))
    assert behind[-1] is failure
    merged = merge_events(token(1), behind)
    assert merged.token_ids == (1, 2) and merged.error is None and merged.finish_reason is None
