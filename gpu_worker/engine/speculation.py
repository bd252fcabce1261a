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
accepted draft). And a step drafts only where its drafts are expected to pay (`Payoff`: the tokens a
drafted row gets accepted, learned over every drafted step, against the break-even of the step's number
of rows and of drafted rows, from measured step times), and never above --speculative-max-rows running
requests. Prompt lookup reads an index of each request's n-grams (`NgramIndex`), a few dict reads a
step; a step that could not pay at its size proposes nothing at all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

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


class NgramIndex:
    """A request's tokens for prompt lookup, and for each n-gram size where each n-gram last ended: a
    proposal is a few dict reads (the last n tokens looked up, n from n_max down), and each step adds its
    new positions, where a scan over every token cost about 10 us a request a step (190 tokens), every
    step, whether anything matched or not (in random text almost nothing does). The tokens only grow (a
    request's known tokens do, preemption included)."""

    __slots__ = ("tokens", "n_min", "tables", "indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.tokens: list[int] = []
        self.n_min = n_min
        # longest first: n -> {n-gram: the latest position it ends at, among positions before `indexed`}
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_max, n_min - 1, -1)}
        self.indexed = 0

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest of the longest earlier occurrences of the tokens' last
        n tokens (n_min <= n <= n_max); none without one. An occurrence fewer than `k` tokens back is a loop
        of that period: the drafts repeat it (`k` of them)."""
        tokens = self.tokens
        n = len(tokens)
        if n <= self.n_min or k <= 0:
            return []
        for end in range(self.indexed, n - 1):  # the positions before the last, not indexed yet
            for size, table in self.tables.items():
                if end >= size - 1:
                    table[tuple(tokens[end - size + 1 : end + 1])] = end
        self.indexed = max(self.indexed, n - 1)
        for size, table in self.tables.items():
            at = table.get(tuple(tokens[n - size :])) if n > size else None
            if at is not None:
                break
        else:
            return []
        drafts = tokens[at + 1 : at + 1 + k]
        period = n - 1 - at  # a match this close repeats with this period: the drafts go on repeating it
        while len(drafts) < k:
            drafts.append(drafts[len(drafts) - period])
        return drafts


@dataclass(eq=False, slots=True)
class DraftState:
    """One request's proposer state: its prompt-lookup index (built on its first proposal), the back-off,
    and its totals."""

    index: NgramIndex | None = None
    resume_at: int = 0  # the step from which it proposes again (backing off before it)
    misses: int = 0  # verified steps in a row with every draft rejected

    def sync(self, request: Request, n_min: int, n_max: int) -> NgramIndex:
        """The request's index, grown by the tokens it lacks."""
        index = self.index
        if index is None:
            index = self.index = NgramIndex(n_min, n_max)
        have, known = len(index.tokens), request.num_tokens
        if known > have:
            index.tokens.extend(request.tokens(have, known))
        return index


class Payoff:
    """Whether a step's drafts pay, learned from the steps themselves. A step of n rows, d of them
    drafted, costs D seconds against a plain step's P and yields n tokens plus those accepted: it pays
    when D / (n + accepted) < P / n, that is when the tokens accepted per drafted row exceed
    (D - P) / d * n / P, the break-even. The break-even is the machine's (what a verify row costs against
    a plain row's share of a step: on CPU a lone verify row among eight costs about seven plain rows more,
    eight of them about two and a half more each), so it is measured per (n, d); the tokens accepted per
    drafted row are the workload's (how often its text repeats), so they are one moving average over every
    drafted step, whatever its size. Step times are moving averages (a fifth of the way a step) over decode-only steps.
    A (n, d) not drafted at yet is given the lowest extra cost a drafted row had at any size (the
    cheapest it could be), and tried when nothing was measured. Where drafting does not pay, it is tried again after 16
    steps, then 32, ... 1024 (doubling while it does not pay, back to 16 once a drafted step pays): one
    schedule for every size, a try lasting until the next drafted step was measured, so a workload that
    changes is noticed and a losing one costs about one drafted step an interval."""

    FIRST_RETRY, LAST_RETRY = 16, 1024

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # False (--no-speculative-payoff): drafting always counts as paying
        self._plain: dict[int, float] = {}  # rows -> seconds of a decode step without drafts
        self._drafted: dict[tuple[int, int], float] = {}  # (rows, rows drafted) -> seconds of such a step
        self.accepted: float | None = None  # tokens accepted per drafted row, every size
        self._retry_at: int | None = None  # the step from which drafting is tried again where it does not pay
        self._interval = self.FIRST_RETRY
        self._trying = False  # tried again: drafting on until a drafted step was measured
        self._last: dict[int, bool] = {}  # rows -> the last verdict at that size

    def break_even(self, rows: int, drafted: int | None = None) -> float | None:
        """Tokens a drafted row must get accepted for a step of `rows` rows, `drafted` of them drafted, to
        pay: measured, else (and with `drafted` None) the lowest measured per row at any size, scaled to
        this one; None where none is known."""
        plain = self._plain.get(rows)
        if plain is None:
            return None
        seconds = self._drafted.get((rows, drafted)) if drafted else None
        if drafted and seconds is not None:
            return (seconds - plain) / drafted * rows / plain
        extra = [(s - self._plain[n]) / d for (n, d), s in self._drafted.items() if n in self._plain]
        return min(extra) * rows / plain if extra else None

    def pays(self, rows: int, drafted: int | None, step: int) -> bool:
        """Whether a step of `rows` rows should verify the drafts of `drafted` of them (at `step`); with
        `drafted` None, whether any number of them could (a False lets the step skip proposing)."""
        if not self.enabled:
            return True
        bar = self.break_even(rows, drafted)
        verdict = bar is None or self.accepted is None or self.accepted > bar or self._trying or self._retry(step)
        self._last[rows] = verdict
        return verdict

    def paid(self, rows: int) -> bool:
        """The last verdict at `rows` (True before one was asked for)."""
        return self._last.get(rows, True)

    def _retry(self, step: int) -> bool:
        if self._retry_at is None:  # it stopped paying: try again later
            self._retry_at = step + self._interval
            return False
        if step < self._retry_at:
            return False
        self._interval = min(2 * self._interval, self.LAST_RETRY)
        self._retry_at = step + self._interval
        self._trying = True  # drafting is on again until a drafted step is measured
        return True

    def observe(self, rows: int, seconds: float, drafted: int, accepted: int) -> None:
        """A decode-only step of `rows` rows took `seconds`; `drafted` of its rows verified drafts,
        `accepted` of those drafts were accepted."""
        if not drafted:
            self._plain[rows] = _average(self._plain.get(rows), seconds)
            return
        self._trying = False
        self._drafted[rows, drafted] = _average(self._drafted.get((rows, drafted)), seconds)
        self.accepted = _average(self.accepted, accepted / drafted)
        bar = self.break_even(rows, drafted)
        if bar is not None and self.accepted > bar:  # it pays here: the next stop waits the first interval
            self._interval = self.FIRST_RETRY


def _average(old: float | None, new: float) -> float:
    """A moving average a fifth of the way to each new value."""
    return new if old is None else 0.8 * old + 0.2 * new


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

    def propose(self, request: Request, limit: int) -> list[int]:
        """At most `limit` drafts after the request's known tokens; none while it backs off."""
        if limit <= 0 or not self.may_draft(request):
            return []
        state = self._state(request)
        if self.step < state.resume_at:
            return []
        if self.mtp:  # the head's proposal after exactly these tokens
            return list(request.mtp_drafts[:limit]) if request.mtp_drafts_at == request.num_tokens else []
        return state.sync(request, self.n_min, self.n_max).propose(min(limit, self.k))

    def head_drafts(self, request: Request, num_running: int) -> int:
        """SequenceChunk.mtp_drafts of a row of `request` that yields: -1 when the MTP head does not run for
        it (prompt lookup, a request that never drafts, more running requests than draft, or a step where
        drafting does not pay: `Payoff`, its last verdict at that size), 0 when it backs off (the head keeps
        its KV), else k. A row that does not yield takes 0 (its KV). Where the head did not run, its KV has
        holes: drafts there are worse when it runs again, never the output."""
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
        rows = len(running)
        if rows > self.max_rows or not self.payoff.pays(rows, None, self.step):
            return running
        out = list(running)
        for i, (state, request) in enumerate(zip(running, requests, strict=True)):
            if state.num_computed_tokens < state.num_prompt_tokens:
                continue
            limit = state.max_tokens - state.num_output_tokens - 1
            if self.mtp and request.num_computed_tokens >= request.num_tokens:  # in flight: its proposal comes
                n = min(limit, self.k) if self.may_draft(request) and self.step >= self._state(request).resume_at else 0
            else:
                n = len(self.propose(request, limit))
            if n > 0:
                out[i] = state._replace(num_draft_tokens=n)
        drafted = sum(1 for state in out if state.num_draft_tokens)
        if not drafted or not self.payoff.pays(rows, drafted, self.step):
            return running
        return tuple(out)

    def drafts_for(self, request: Request, granted: int, checkpoint_at: int | None) -> tuple[int, ...]:
        """The drafts of a decode slice granted `granted` of them (module docstring, prepare); the slice
        starts at the request's newest token. `checkpoint_at`: the next block boundary where the prefix
        cache would checkpoint, if any: the slice stops short of it."""
        start = request.num_computed_tokens
        limit = min(granted, request.params.max_tokens - len(request.output_token_ids) - 1)
        if checkpoint_at is not None:
            limit = min(limit, checkpoint_at - start - 2)
        drafts = self.propose(request, limit)
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
    speculator.payoff.observe(len(served), seconds, len(record.drafts), record.num_accepted_tokens)


def step_drafts(prepared: PreparedStep, sampled: StepOutput | None) -> tuple[tuple[str, int, int], ...]:
    """StepRecord.drafts: (request id, drafted, accepted) of each drafted row that was verified."""
    if sampled is None or not sampled.drafts:
        return ()
    rows = prepared.rows
    return tuple((rows[v.row].request.request_id, v.num_drafted, len(v.token_ids)) for v in sampled.drafts)
