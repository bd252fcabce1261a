"""The output processor: a sampled token's effect on its request. Appends it, detokenises it,
checks EOS, stop strings and max_tokens, and streams it; a request that ends gets an `Ending`,
whose last event is delivered once the step's observers have seen the step.

Events wait in the `outbox` until the engine calls `flush`: it does so once the next forward is under
way (or when no forward follows), so that the stream threads the events wake run while the model
computes rather than between two steps. Each request's events keep their order."""

from __future__ import annotations

import queue
from dataclasses import dataclass

from gpu_worker.engine.finish import FinishReason
from gpu_worker.engine.request import Request, RequestOutput
from gpu_worker.sampling import TopLogprobs
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

    def append(self, request: Request, token_id: int, logprob: float, top: TopLogprobs) -> Ending | None:
        """Appends one sampled token: streams it now, or returns the request's ending (the token
        rides on the last event)."""
        outputs, params = request.output_token_ids, request.params
        outputs.append(token_id)
        is_eos = token_id in self._eos_ids and not params.ignore_eos
        text, hit_stop = request.stop_checker.push([]) if is_eos else request.stop_checker.push_one(token_id)
        if not (is_eos or hit_stop) and len(outputs) < params.max_tokens:  # the common case: it goes on
            # RequestOutput((token_id,), (logprob,), (top,), text) without its Python constructor
            self.outbox.append(
                (request.events, _new(RequestOutput, ((token_id,), (logprob,), (top,), text, None, 0, 0, 0, None)))
            )
            return None
        reason = finish_reason(is_eos, hit_stop, len(outputs) >= params.max_tokens)
        assert reason is not None
        if not hit_stop:
            text += request.stop_checker.flush()
        event = RequestOutput((token_id,), (logprob,), (top,), text)
        return Ending(request, reason, request.last_output(reason, event))

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


def finish_reason(is_eos: bool, hit_stop: bool, reached_max_tokens: bool) -> FinishReason | None:
    """Why the request ends after this token, if it does. A stop string wins (its text is cut
    there), then EOS, then the length limit: the token that hits the limit may also be EOS."""
    if hit_stop:
        return FinishReason.STOP
    if is_eos:
        return FinishReason.EOS
    if reached_max_tokens:
        return FinishReason.LENGTH
    return None
