"""Speculative decoding, engine side: what each request drafts, and the accepted drafts applied.

Drafts come from prompt lookup (n-gram): the request's own tokens are searched for the longest
earlier occurrence of their last n tokens (n from --ngram-max down to --ngram-min, the latest
occurrence among the longest), and the tokens that followed it there are the drafts, at most
--num-speculative-tokens of them. The runner verifies them (gpu_worker.runner.speculation): its
output is that of a plain decode, so a proposal only ever costs time, never correctness.

Per step:

- snapshot  each running decode that may draft tells the planner how many drafts it has ready
            (RequestState.num_draft_tokens): its proposal's length now. A request in the step still in
            flight (async scheduling) is proposed from the tokens known so far, without the one in flight.
- prepare   a decode slice of 1 + e tokens carries the newest token and e drafts, proposed again then from
            every known token and cut to e, to the generation limit, and short of the next block boundary
            where the prefix cache checkpoints (a checkpoint is only ever the state after accepted tokens).
            Its request counts the newest token computed, as if every draft were rejected.
- apply     the accepted drafts, then the model's own token, each like a decode's token (stop strings,
            EOS and max_tokens end the request between them); computed tokens advance by the accepted.

Under async scheduling step N+1 is planned while step N runs, before its acceptance is known: it is
planned as if every draft of step N is rejected, and the pages that accepting them all could need more
(`page_reserve`) are held back from the free pages the planner is told.

Which requests draft: those with no prompt scoring, past their prompt. Penalties and min_tokens are
applied at each verified position with the drafts before it counted (gpu_worker.runner.speculation.
DraftHistories); a grammar's drafts are cut at prepare to the prefix it accepts, and each position is
sampled with the grammar's mask after the drafts before it (gpu_worker.engine.grammar.StepMasks).
Speculation stops itself where it does not pay, two ways. A request whose drafts were all rejected
proposes nothing for the next 2, 4, 8 or 16 steps (doubling with each further miss, reset by an
accepted draft), so a workload whose text does not repeat drafts almost never. And a step drafts only
where drafting has paid at its batch size (`Payoff`: a verify step's time against the tokens it yielded
and a plain step's time, both measured), and never above --speculative-max-rows running requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gpu_worker.engine.request import Request
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.runner.protocol import StepOutput, TopLogprobs, Verified
from scheduler_svc.core import RequestState

if TYPE_CHECKING:
    from gpu_worker.engine.output import Ending, OutputProcessor
    from gpu_worker.engine.prepare import PreparedStep, Row
    from gpu_worker.engine.records import StepRecord

# a step's tokens as OutputProcessor.append_step takes them: requests, tokens, log-probabilities, alternatives
StepTokens = tuple[list[Request], list[int], list[float], list[TopLogprobs] | None]

MAX_BACKOFF_STEPS = 16


@dataclass(eq=False, slots=True)
class DraftState:
    """One request's proposer state: its tokens as an array (grown, never rewritten: a request's known
    tokens only grow, preemption included), the back-off, and its totals."""

    tokens: np.ndarray = field(default_factory=lambda: np.empty(64, dtype=np.int64))
    length: int = 0  # tokens[:length] are the request's first tokens
    resume_at: int = 0  # the step from which it proposes again (backing off before it)
    misses: int = 0  # verified steps in a row with every draft rejected

    def sync(self, request: Request, upto: int) -> np.ndarray:
        """The request's first `upto` tokens, the array grown by what it lacks."""
        if upto > self.length:
            if upto > len(self.tokens):
                grown = np.empty(max(upto, 2 * len(self.tokens)), dtype=np.int64)
                grown[: self.length] = self.tokens[: self.length]
                self.tokens = grown
            self.tokens[self.length : upto] = request.tokens(self.length, upto)
            self.length = upto
        return self.tokens[:upto]


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest of the longest earlier occurrences of `tokens`' last n
    tokens (n_min <= n <= n_max); none without one. An occurrence fewer than `k` tokens back is a loop
    of that period: the drafts repeat it (`k` of them). One comparison over the tokens, then the few
    candidates that end with the last token are extended backwards."""
    n = len(tokens)
    if n <= n_min or k <= 0:
        return []
    last = tokens[n - 1]
    ends = np.flatnonzero(tokens[: n - 1] == last)  # earlier positions holding the last token
    if len(ends) == 0:
        return []
    length = np.ones(len(ends), dtype=np.int64)  # matched length ending at each candidate
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, n_max):
        ok = alive & (ends >= back)
        ok[ok] = tokens[ends[ok] - back] == tokens[n - 1 - back]
        length += ok
        alive = ok
        if not alive.any():
            break
    best = int(length.max())
    if best < n_min:
        return []
    at = int(ends[np.flatnonzero(length == best)[-1]])
    drafts = [int(t) for t in tokens[at + 1 : at + 1 + k]]
    period = n - 1 - at  # a match this close repeats with this period: the drafts go on repeating it
    while len(drafts) < k:
        drafts.append(drafts[len(drafts) - period])
    return drafts


class Payoff:
    """Whether drafting pays at a batch size, learned from the steps themselves. A verify step runs off
    the compiled decode program and scores 1 + k positions a row, so it may cost several plain steps (on
    CPU with the whole-step program, a one-row verify step costs about six): drafting pays at n rows when
    the tokens per row it yields, times a plain step's time, exceed a drafted step's time. Both times and
    the yield are moving averages (a fifth of the way a step) over decode-only steps of n rows. Unmeasured,
    drafting is tried; where it did not pay it is tried again after 16 steps, then 32, ... 1024 (doubling
    while it still does not pay), each time until a drafted step of that size was measured, so a workload
    that changes is noticed and a losing one costs little."""

    FIRST_RETRY, LAST_RETRY = 16, 1024

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # False (--no-speculative-payoff): drafting always counts as paying
        self._plain: dict[int, float] = {}  # rows -> seconds of a decode step without drafts
        self._drafted: dict[int, float] = {}  # rows -> seconds of a decode step with drafts
        self._yield: dict[int, float] = {}  # rows -> tokens a row of those steps yielded
        self._retry: dict[int, tuple[int, int]] = {}  # rows -> (the step from which to try again, the interval)
        self._trial: set[int] = set()  # sizes tried again, not measured drafting since
        self._last: dict[int, bool] = {}  # rows -> what `pays` said last

    def pays(self, rows: int, step: int) -> bool:
        if not self.enabled:
            return True
        plain, drafted = self._plain.get(rows), self._drafted.get(rows)
        if plain is None or drafted is None or self._yield[rows] * plain > drafted or rows in self._trial:
            self._last[rows] = True
            return True
        self._last[rows] = self._decide(rows, step)
        return self._last[rows]

    def paid(self, rows: int) -> bool:
        """What `pays` last said at `rows` (True before it was asked)."""
        return self._last.get(rows, True)

    def _decide(self, rows: int, step: int) -> bool:
        retry = self._retry.get(rows)
        if retry is None:  # it stopped paying: try again later
            self._retry[rows] = (step + self.FIRST_RETRY, self.FIRST_RETRY)
            return False
        at, interval = retry
        if step < at:
            return False
        interval = min(2 * interval, self.LAST_RETRY)
        self._retry[rows] = (step + interval, interval)
        self._trial.add(rows)  # drafting is on again until a drafted step of this size is measured
        return True

    def observe(self, rows: int, seconds: float, drafted: bool, accepted: int) -> None:
        """A decode-only step of `rows` rows took `seconds`; `drafted`: it verified drafts, `accepted` of them."""
        times = self._drafted if drafted else self._plain
        if drafted:
            self._trial.discard(rows)
        old = times.get(rows)
        times[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds
        if drafted:
            tokens = 1.0 + accepted / rows
            old = self._yield.get(rows)
            self._yield[rows] = tokens if old is None else 0.8 * old + 0.2 * tokens
            if self._yield[rows] * self._plain.get(rows, 0.0) > self._drafted[rows]:
                self._retry.pop(rows, None)  # it pays again: the next miss waits the first interval


def speculator_for(settings: EngineSettings) -> Speculator | None:
    """The engine's speculator, or None with --num-speculative-tokens 0."""
    k = settings.num_speculative_tokens
    if not k:
        return None
    rows = settings.runner.num_draft_rows // k
    speculator = Speculator(
        k, settings.ngram_min, settings.ngram_max, rows, settings.scheduler.kv_page_size, settings.speculative_method
    )
    speculator.payoff.enabled = settings.speculative_payoff
    return speculator


class Speculator:
    """The engine's drafts: who proposes, what, and what each verification says (module docstring)."""

    def __init__(
        self, num_tokens: int, ngram_min: int, ngram_max: int, max_rows: int, page_size: int, method: str = "ngram"
    ) -> None:
        self.k, self.n_min, self.n_max = num_tokens, ngram_min, ngram_max
        self.mtp = method == "mtp"  # drafts from the runner's MTP head (StepOutput.proposals), not prompt lookup
        self.max_rows = max_rows  # rows drafting in one step at most (the runner's draft rows / k)
        self.page_size = page_size
        self._states: dict[str, DraftState] = {}
        self.step = 0  # steps passed
        self.payoff = Payoff()

    @staticmethod
    def may_draft(request: Request) -> bool:
        return not request.scoring

    def _state(self, request: Request) -> DraftState:
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = DraftState()
        return state

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def propose(self, request: Request, upto: int, limit: int) -> list[int]:
        """At most `limit` drafts from the request's first `upto` tokens; none while it backs off."""
        if limit <= 0 or not self.may_draft(request):
            return []
        state = self._state(request)
        if self.step < state.resume_at:
            return []
        if self.mtp:  # the head's proposal after exactly these tokens
            return list(request.mtp_drafts[:limit]) if request.mtp_drafts_at == upto else []
        return propose_ngram(state.sync(request, upto), min(limit, self.k), self.n_min, self.n_max)

    def head_drafts(self, request: Request, num_running: int) -> int:
        """SequenceChunk.mtp_drafts of a row of `request` that yields: -1 when the MTP head does not run for
        it (prompt lookup, a request that never drafts, more running requests than draft, or a batch size
        where drafting does not pay: `Payoff`), 0 when it backs off (the head keeps its KV), else k. A row
        that does not yield takes 0 (its KV). Where the head did not run, its KV has holes: drafts there
        are worse when it runs again, never the output."""
        if not self.mtp or not self.may_draft(request) or num_running > self.max_rows:
            return -1
        if not self.payoff.paid(num_running):
            return -1
        if self.step < self._state(request).resume_at:
            return 0
        return self.k

    def proposed(self, rows: Sequence[Row], proposals: Sequence[tuple[int, tuple[int, ...]]]) -> None:
        """The MTP head's drafts of the step's rows (StepOutput.proposals), after their tokens were applied."""
        for row, drafts in proposals:
            request = rows[row].request
            request.mtp_drafts, request.mtp_drafts_at = drafts, request.num_tokens

    def with_drafts(self, running: tuple[RequestState, ...], requests: Sequence[Request]) -> tuple[RequestState, ...]:
        """`running` (in `requests`' order) with each decode's ready drafts (module docstring, snapshot), for
        steps of at most `max_rows` running requests where drafting pays (`Payoff`; a larger batch decodes
        without drafts: its step is cheap per token already). A request of the step in flight is proposed
        from its known tokens."""
        if len(running) > self.max_rows or not self.payoff.pays(len(running), self.step):
            return running
        out = list(running)
        for i, (state, request) in enumerate(zip(running, requests, strict=True)):
            if state.num_computed_tokens < state.num_prompt_tokens:
                continue
            limit = state.max_tokens - state.num_output_tokens - 1
            if self.mtp and request.num_computed_tokens >= request.num_tokens:  # in flight: its proposal comes
                n = min(limit, self.k) if self.may_draft(request) and self.step >= self._state(request).resume_at else 0
            else:
                n = len(self.propose(request, request.num_tokens, limit))
            if n > 0:
                out[i] = state._replace(num_draft_tokens=n)
        return tuple(out)

    def drafts_for(self, request: Request, granted: int, checkpoint_at: int | None) -> tuple[int, ...]:
        """The drafts of a decode slice granted `granted` of them (module docstring, prepare); the slice
        starts at the request's newest token. `checkpoint_at`: the next block boundary where the prefix
        cache would checkpoint, if any: the slice stops short of it."""
        start = request.num_computed_tokens
        limit = min(granted, request.params.max_tokens - len(request.output_token_ids) - 1)
        if checkpoint_at is not None:
            limit = min(limit, checkpoint_at - start - 2)
        drafts = self.propose(request, request.num_tokens, limit)
        grammar = request.grammar
        if drafts and grammar is not None:  # no step runs now: the matcher is the engine thread's
            grammar.sync(request.output_token_ids)
            drafts = drafts[: grammar.valid_prefix(drafts)]
        return tuple(drafts)

    def page_reserve(self, in_flight: Sequence[Row]) -> int:
        """Pages the accepted drafts of the step in flight could need beyond what the next plan counts
        (it counts them rejected): a request's end moves by up to e tokens, over at most ceil(e / page)
        page boundaries."""
        page = self.page_size
        return sum(-(-row.chunk.num_draft_tokens // page) for row in in_flight if row.chunk.num_draft_tokens)

    def verified(self, request: Request, v: Verified) -> None:
        """Counts a verification, and backs the request off when it accepted nothing."""
        state = self._state(request)
        accepted = len(v.token_ids)
        request.num_draft_tokens += v.num_drafted
        request.num_accepted_tokens += accepted
        if accepted:
            state.misses = 0
        else:
            state.misses += 1
            state.resume_at = self.step + min(1 << state.misses, MAX_BACKOFF_STEPS)

    def apply(
        self, outputs: OutputProcessor, prepared: PreparedStep, sampled: StepOutput, now: float
    ) -> tuple[list[Ending], StepTokens]:
        """Each drafted row's accepted drafts appended to its request, ahead of the step's own tokens
        (module docstring, apply). Returns the requests that ended on a draft, and the step's tokens
        without theirs."""
        endings: list[Ending] = []
        ended: set[int] = set()
        rows = prepared.rows
        for v in sampled.drafts:
            request = rows[v.row].request
            request.num_computed_tokens += len(v.token_ids)
            self.verified(request, v)
            for token, logprob, top in zip(v.token_ids, v.logprobs, v.top_logprobs, strict=True):
                tops = [top] if sampled.top_logprobs is not None else None
                ending, _ = outputs.append_step([request], [token], [logprob], tops, now)
                if ending:
                    endings.extend(ending)
                    ended.add(v.row)
                    break
        requests, tokens = prepared.yielding, (sampled.token_ids, sampled.logprobs, sampled.top_logprobs)
        if not ended:
            return endings, (requests, *tokens)
        keep = [i for i, row in enumerate(prepared.yielding_rows) if row not in ended]
        tops = sampled.top_logprobs
        return endings, (
            [requests[i] for i in keep], [sampled.token_ids[i] for i in keep], [sampled.logprobs[i] for i in keep],
            [tops[i] for i in keep] if tops is not None else None,
        )  # fmt: skip


def observe_step(speculator: Speculator, record: StepRecord) -> None:
    """Feeds a finished step to the speculator's `Payoff` (decode-only steps of at most max_rows rows)."""
    served = record.served
    if not served or len(served) > speculator.max_rows or any(s.is_prefill for s in served):
        return
    seconds = record.wall_s - record.plan_wait_s
    speculator.payoff.observe(len(served), seconds, bool(record.drafts), record.num_accepted_tokens)


def step_drafts(prepared: PreparedStep, sampled: StepOutput | None) -> tuple[tuple[str, int, int], ...]:
    """StepRecord.drafts: (request id, drafted, accepted) of each drafted row that was verified."""
    if sampled is None or not sampled.drafts:
        return ()
    rows = prepared.rows
    return tuple((rows[v.row].request.request_id, v.num_drafted, len(v.token_ids)) for v in sampled.drafts)
