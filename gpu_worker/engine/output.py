"""The output processor: a sampled token's effect on its request. Appends it, detokenises it,
checks EOS, stop strings and max_tokens, and streams it; a request that ends gets an `Ending`,
whose last event is delivered once the step's observers have seen the step.

Events wait in the `outbox` until the engine calls `flush`: it does so once the next forward is under
way (or when no forward follows), so that the stream threads the events wake run while the model
computes rather than between two steps. Each request's events keep their order."""

from __future__ import annotations

import queue
from dataclasses import dataclass
from itertools import repeat

from gpu_worker.engine.request import FinishReason, Request, RequestOutput
from gpu_worker.runner.protocol import TopLogprobs
from hybridserve.errors import HybridServeError

_new = tuple.__new__


@dataclass(frozen=True, slots=True)
class Ending:
    """A request that left the engine, and the last event its client gets."""

    request: Request
    reason: FinishReason
    last: RequestOutput
    error: HybridServeError | None = None  # reason is ERROR; the stream raises it


class OutputProcessor:
    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self._eos_ids = frozenset(eos_token_ids)
        self.outbox: list[tuple[queue.SimpleQueue[RequestOutput], RequestOutput]] = []  # (request's queue, event)

    def flush(self) -> None:
        """Hands every waiting event to its stream, in order."""
        outbox, self.outbox = self.outbox, []
        for events, event in outbox:
            events.put(event)

    def append_step(
        self,
        requests: list[Request],
        token_ids: list[int],
        logprobs: list[float],
        top_logprobs: list[TopLogprobs] | None,
        now: float,
    ) -> tuple[list[Ending], list[Request]]:
        """Appends each row's sampled token to its request, in row order: streams it, or ends the
        request (the token rides on the last event). Returns the endings, and the requests whose
        first token this was (their first_token_time set to `now`)."""
        endings: list[Ending] = []
        firsts: list[Request] = []
        put, eos_ids = self.outbox.append, self._eos_ids
        tops = top_logprobs or repeat((), len(requests))
        for request, token_id, logprob, top in zip(requests, token_ids, logprobs, tops, strict=True):
            scores: tuple[float, ...] = ()
            if request.first_token_time is None:
                request.first_token_time = now
                firsts.append(request)
                if request.scoring:  # the prompt log-probabilities ride on the first event
                    request.scoring = False
                    scores = tuple(request.prompt_logprobs)
            outputs, params, checker = request.output_token_ids, request.params, request.stop_checker
            if not params.max_tokens:  # no new tokens: the prompt was read (and scored); the sample is dropped
                last = request.last_output(FinishReason.LENGTH, RequestOutput(prompt_logprobs=scores))
                endings.append(Ending(request, FinishReason.LENGTH, last))
                continue
            outputs.append(token_id)
            if request.grammar is not None and request.grammar.advance(token_id):  # the grammar is complete
                text = checker.push([])[0] if token_id in eos_ids else checker.push_one(token_id)
                endings.append(_ending(request, token_id, logprob, top, None, text, scores, complete=True))
                continue
            if token_id in eos_ids and not params.ignore_eos:
                endings.append(_ending(request, token_id, logprob, top, FinishReason.EOS, checker.push([])[0], scores))
                continue
            text = checker.push_one(token_id)  # a special token's text is "" (the detokenizer skips them)
            if params.stop_token_ids and token_id in params.stop_token_ids:
                endings.append(_ending(request, token_id, logprob, top, FinishReason.STOP, text, scores))
                continue
            if checker.stopped or len(outputs) >= params.max_tokens:
                endings.append(_ending(request, token_id, logprob, top, None, text, scores))
                continue
            if scores:
                put((request.events, RequestOutput((token_id,), (logprob,), (top,), text, prompt_logprobs=scores)))
                continue
            # the common case, it goes on: RequestOutput((token_id,), (logprob,), (top,), text) without
            # its Python constructor
            put((request.events, _new(RequestOutput, ((token_id,), (logprob,), (top,), text, None, 0, 0, 0, None, ()))))
        return endings, firsts

    @staticmethod
    def aborted(request: Request, reason: FinishReason) -> Ending:
        """Ended from outside the step (abort): an empty last event with the usage."""
        return Ending(request, reason, request.last_output(reason))

    @staticmethod
    def failed(request: Request, error: HybridServeError) -> Ending:
        """Ended by an error: the stream raises it."""
        return Ending(request, FinishReason.ERROR, RequestOutput(error=error), error)

    def deliver(self, ending: Ending) -> None:
        self.outbox.append((ending.request.events, ending.last))


def _ending(
    request: Request, token_id: int, logprob: float, top: TopLogprobs, by: FinishReason | None, text: str,
    prompt_logprobs: tuple[float, ...] = (), complete: bool = False,
) -> Ending:  # fmt: skip
    """The ending of a request whose token (already appended, its text `text`) is its last: `by` EOS or a
    stop token id (STOP), else a stop string, a completed grammar (`complete`: STOP) or the length limit."""
    hit_stop = request.stop_checker.stopped
    if hit_stop or complete or by is None:
        reason = finish_reason(False, hit_stop or complete, len(request.output_token_ids) >= request.params.max_tokens)
    else:
        reason = by
    assert reason is not None
    if not hit_stop:
        text += request.stop_checker.flush()
    event = RequestOutput((token_id,), (logprob,), (top,), text, prompt_logprobs=prompt_logprobs)
    return Ending(request, reason, request.last_output(reason, event))


def finish_reason(is_eos: bool, hit_stop: bool, reached_max_tokens: bool) -> FinishReason | None:
    """Why the request ends after this token, if it does. A stop string wins (its text is cut
    there; a completed grammar counts as one), then EOS, then the length limit: the token that hits the
    limit may also be EOS."""
    if hit_stop:
        return FinishReason.STOP
    if is_eos:
        return FinishReason.EOS
    if reached_max_tokens:
        return FinishReason.LENGTH
    return None
