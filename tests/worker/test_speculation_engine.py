"""The engine's side of speculative decoding (gpu_worker.engine.speculation), one layer at a time: prompt
lookup, who drafts, the back-off, the page reserve, and the settings' checks. The verification and the
state rollback are the runner's (tests/model/test_speculation_runner.py); served end to end in
tests/model/test_speculation_serving.py."""

from __future__ import annotations

import argparse
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.api.server import add_arguments, settings_from_args
from gpu_worker.engine.prepare import Row, _chain_room
from gpu_worker.engine.request import GenerationParams, Request, StopChecker
from gpu_worker.engine.settings import (
    COMPILED_SPECULATIVE_ROWS,
    SPECULATIVE_ROWS,
    EngineSettings,
    draft_rows_for,
    speculative_rows,
)
from gpu_worker.engine.speculation import MAX_BACKOFF_STEPS, NgramIndex, Payoff, Speculator
from gpu_worker.runner.protocol import KVPagePool, SamplingParams, SequenceChunk, Verified
from gpu_worker.runner.settings import RunnerConfig
from hybridserve.errors import InvalidArgumentError
from scheduler_svc.core import SchedulerConfig, Slice


def ngram(tokens: list[int], k: int = 4, lo: int = 2, hi: int = 4) -> list[int]:
    index = NgramIndex(lo, hi)
    index.tokens.extend(tokens)
    return index.propose(k)


def scanned(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Prompt lookup by its definition, a scan: every earlier position's match length with the end."""
    n = len(tokens)
    best, at = 0, -1
    for end in range(n - 1):
        length = 0
        while length < min(hi, end + 1) and tokens[end - length] == tokens[n - 1 - length]:
            length += 1
        if length >= max(best, 1):
            best, at = length, end
    if best < lo or k <= 0:
        return []
    drafts = tokens[at + 1 : at + 1 + k]
    while len(drafts) < k:
        drafts.append(drafts[len(drafts) - (n - 1 - at)])
    return drafts


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=0, max_size=60), st.integers(1, 40), st.integers(1, 5),
    st.integers(1, 3), st.integers(0, 2),
)  # fmt: skip
def test_the_index_proposes_what_a_scan_of_the_tokens_finds_as_they_grow(
    tokens: list[int], split: int, k: int, lo: int, extra: int
) -> None:
    """The index, grown a step at a time (a proposal after each), proposes what scanning every position
    proposes: the latest of the longest matches, the loop repeated."""
    hi = lo + extra
    index = NgramIndex(lo, hi)
    for start in [*range(0, len(tokens), split), len(tokens)]:
        index.tokens.extend(tokens[len(index.tokens) : start])
        assert index.propose(k) == scanned(index.tokens, k, lo, hi), index.tokens


def test_prompt_lookup_takes_what_followed_the_latest_longest_match() -> None:
    assert ngram([5, 6, 7, 8, 9, 1, 5, 6]) == [7, 8, 9, 1]
    # [2, 5, 6] matches at 1..3 (length 3) and [5, 6] also at 7..8: the longer match wins over the later one
    assert ngram([1, 2, 5, 6, 40, 41, 9, 5, 6, 30, 31, 2, 5, 6]) == [40, 41, 9, 5]
    assert ngram([5, 6, 10, 11, 12, 13, 7, 5, 6, 20, 21, 22, 23, 9, 5, 6]) == [20, 21, 22, 23]  # latest of equals
    assert ngram([5, 6, 7, 8, 9, 1, 5, 6], k=2) == [7, 8]
    assert ngram([1, 2, 3, 4, 5, 6]) == []  # the last token never occurred before
    assert ngram([1, 2, 3, 9, 8, 3]) == []  # only a 1-token match: below ngram_min
    assert ngram([1, 2, 3, 9, 8, 3], lo=1) == [9, 8, 3, 9]


def test_a_match_fewer_than_k_tokens_back_is_a_loop_the_drafts_repeat() -> None:
    assert ngram([1, 2, 3, 508, 508, 508]) == [508] * 4
    assert ngram([9, 10, 11, 37, 10, 11, 37, 10]) == [11, 37, 10, 11]


def make_request(rid: str, prompt: list[int], max_tokens: int = 64, **sampling: object) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=prompt, params=GenerationParams(SamplingParams(**sampling), max_tokens),
        arrival_time=time.monotonic(), deadline=None, stop_checker=StopChecker(None, ()),
    )  # fmt: skip


LOOP = [7, 8, 9] * 4


class _Grammar:
    """A grammar that accepts the first `accepts` tokens of any drafts (the matcher's validate_tokens)."""

    def __init__(self, accepts: int) -> None:
        self.accepts, self.synced_to = accepts, None

    def sync(self, outputs: list[int]) -> None:
        self.synced_to = list(outputs)

    def valid_prefix(self, tokens: list[int]) -> int:
        return min(self.accepts, len(tokens))


def test_which_requests_draft_and_a_grammar_cuts_its_drafts() -> None:
    """Penalties and min_tokens draft (the runner counts the drafts in their history at each position);
    a constrained request drafts what its grammar accepts of its proposal, checked after its own output;
    a request scoring its prompt drafts none."""
    spec = Speculator(4, 2, 4, max_rows=4, page_size=16)
    assert spec.propose(make_request("a", LOOP), 4) == [7, 8, 9, 7]
    assert spec.propose(make_request("b", LOOP, presence_penalty=0.5), 4) == [7, 8, 9, 7]
    assert spec.propose(make_request("c", LOOP, min_tokens=3, held_token_ids=(0,)), 4) == [7, 8, 9, 7]
    constrained = make_request("g", LOOP[:6])
    constrained.output_token_ids.append(LOOP[6])
    constrained.num_computed_tokens = 6  # its newest token, LOOP[6], to compute with the drafts
    proposal = spec.propose(constrained, 4)
    assert len(proposal) == 4
    for accepts in (4, 2, 0):
        constrained.grammar = grammar = _Grammar(accepts)  # type: ignore[assignment]
        assert spec.drafts_for(constrained, 4, None) == tuple(proposal[:accepts])
        assert grammar.synced_to == [LOOP[6]], "the grammar checks the drafts after the request's output"
    scoring = make_request("s", LOOP)
    scoring.scoring = True
    assert spec.propose(scoring, 4) == []
    assert spec.propose(make_request("d", LOOP), 2) == [7, 8]  # the limit cuts
    assert spec.propose(make_request("e", LOOP), 0) == []


def test_a_request_whose_drafts_all_miss_backs_off_doubling_up_to_the_cap() -> None:
    spec = Speculator(4, 2, 4, max_rows=4, page_size=16)
    request = make_request("r", LOOP)
    pauses = []
    for _ in range(6):
        spec.verified(request, Verified(0, 4, (), (), ()))
        start = spec.step
        while not spec.propose(request, 4):
            spec.step += 1
        pauses.append(spec.step - start)
    assert pauses == [2, 4, 8, 16, MAX_BACKOFF_STEPS, MAX_BACKOFF_STEPS]
    spec.verified(request, Verified(0, 4, (7,), (0.0,), ((),)))  # an accepted draft resets it
    spec.verified(request, Verified(0, 4, (), (), ()))
    start = spec.step
    while not spec.propose(request, 4):
        spec.step += 1
    assert spec.step - start == 2
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (32, 1)


def test_steps_of_more_running_requests_than_the_row_limit_draft_nothing() -> None:
    spec = Speculator(4, 2, 4, max_rows=2, page_size=16)
    requests = [make_request(f"r{i}", LOOP[:-1]) for i in range(3)]
    for r in requests:  # decoding: the last token generated, not computed yet
        r.output_token_ids.append(LOOP[-1])
        r.num_computed_tokens = len(LOOP) - 1
    states = tuple(r.sched_state() for r in requests)
    assert [s.num_draft_tokens for s in spec.with_drafts(states[:2], requests[:2])] == [4, 4]
    assert spec.with_drafts(states, requests) == states


def test_settings_refuse_what_cannot_run() -> None:
    def settings(**kw: object) -> EngineSettings:
        k = int(kw.get("num_speculative_tokens", 0))  # type: ignore[call-overload]
        rows = int(kw.pop("draft_rows", draft_rows_for(max(k, 0), 4)))  # type: ignore[call-overload]
        mtp = int(kw.pop("mtp_draft_tokens", 0))  # type: ignore[call-overload]
        return EngineSettings(
            scheduler=SchedulerConfig(), runner=RunnerConfig(num_draft_rows=rows, mtp_draft_tokens=mtp),
            scheduler_addresses=("x:1",), **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    assert settings(num_speculative_tokens=4).num_speculative_tokens == 4
    with pytest.raises(InvalidArgumentError, match="num-speculative-tokens must be >= 0"):
        settings(num_speculative_tokens=-1)
    with pytest.raises(InvalidArgumentError, match="speculative-method 'eagle' is not supported; use one of ngram"):
        settings(num_speculative_tokens=4, speculative_method="eagle")
    assert settings(num_speculative_tokens=2, speculative_method="mtp", mtp_draft_tokens=2).speculative_method == "mtp"
    with pytest.raises(InvalidArgumentError, match="needs the runner's mtp_draft_tokens = 2, got 0"):
        settings(num_speculative_tokens=2, speculative_method="mtp")
    with pytest.raises(InvalidArgumentError, match="ngram-min 3 and --ngram-max 2"):
        settings(num_speculative_tokens=4, ngram_min=3, ngram_max=2)
    with pytest.raises(InvalidArgumentError, match="draft rows"):
        settings(num_speculative_tokens=4, draft_rows=2)
    with pytest.raises(InvalidArgumentError, match="speculative-max-rows must be >= 0"):
        settings(num_speculative_tokens=4, speculative_max_rows=-1)
    assert settings(num_speculative_tokens=4).speculative_max_rows == SPECULATIVE_ROWS  # auto, built directly


def test_the_drafting_row_limit_on_auto_follows_the_compiled_verify_programs() -> None:
    """8 rows where prompt lookup's verify steps are compiled (the largest bucket up to 8), else 4; a value
    given is kept. The worker's flags resolve it, and size the draft rows by it."""
    assert speculative_rows(0, "ngram", ()) == SPECULATIVE_ROWS == 4
    assert speculative_rows(0, "ngram", (1, 2, 4, 8)) == COMPILED_SPECULATIVE_ROWS == 8
    assert speculative_rows(0, "ngram", (1, 2, 16)) == 2
    assert speculative_rows(0, "mtp", (1, 2, 4, 8)) == 4, "the MTP head's verify steps run eagerly"
    assert speculative_rows(3, "ngram", (1, 2, 4, 8)) == 3
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flags, rows in (([], 4), (["--compile-step-sizes", "auto"], 8), (["--speculative-max-rows", "2"], 2)):
        args = parser.parse_args(["--model", "m", "--num-speculative-tokens", "3", *flags])
        got = settings_from_args(args)
        assert (got.speculative_max_rows, got.runner.num_draft_rows, got.runner.verify_tokens) == (rows, 3 * rows, 4)


def test_drafting_stops_where_its_steps_cost_more_than_they_yield_and_is_tried_again_later() -> None:
    payoff = Payoff()
    assert payoff.pays(1, 1, 0), "unmeasured: tried"
    payoff.observe(1, 0.002, drafted=0, accepted=0)
    payoff.observe(1, 0.012, drafted=1, accepted=4)  # 5 tokens for 6 plain steps' time
    assert payoff.break_even(1, 1) == pytest.approx(5.0)
    tries = []
    for step in range(2000):
        if payoff.pays(1, 1, step):
            tries.append(step)
            payoff.observe(1, 0.012, drafted=1, accepted=4)  # the try measured: it still does not pay
    assert tries == [16, 48, 112, 240, 496, 1008]
    assert not payoff.paid(1)
    # a try stays on until a drafted step was measured (a step whose requests drafted nothing does not
    # count): the MTP head must run a step before drafts exist to measure
    assert [payoff.pays(1, 1, step) for step in (2032, 2033, 2034)] == [True, True, True] and payoff.paid(1)
    payoff.observe(1, 0.012, drafted=1, accepted=4)
    assert not payoff.pays(1, 1, 2035)
    off = Payoff(enabled=False)  # --no-speculative-payoff: drafting always counts as paying
    off.observe(1, 0.002, drafted=0, accepted=0)
    off.observe(1, 0.012, drafted=1, accepted=0)
    assert all(off.pays(1, 1, step) for step in range(100)) and off.paid(1)
    payoff.observe(2, 0.003, drafted=0, accepted=0)
    for _ in range(20):  # 4 tokens a drafted row, where each costs a plain row (1.5 ms): acceptance past 3
        payoff.observe(2, 0.006, drafted=2, accepted=8)
    assert payoff.break_even(2, 2) == pytest.approx(1.0) and payoff.accepted > 3
    assert all(payoff.pays(2, 2, step) for step in range(3000, 3100))


def test_the_acceptance_is_the_workloads_across_sizes_and_the_break_even_each_step_shapes() -> None:
    """What a drafted row gets accepted is learned over every drafted step and decides at every size:
    text that does not repeat, measured at one row, keeps a size never drafted at from proposing at all.
    The break-even is measured per (rows, rows drafted): one verify row among eight costs the step six
    plain rows, eight of them two each."""
    payoff = Payoff()
    payoff.observe(1, 0.002, drafted=0, accepted=0)
    payoff.observe(8, 0.008, drafted=0, accepted=0)
    payoff.observe(1, 0.005, drafted=1, accepted=0)  # 1.5 plain steps more for nothing
    assert payoff.break_even(1, 1) == pytest.approx(1.5) and payoff.accepted == 0
    assert payoff.break_even(8) == pytest.approx(3.0), "unmeasured: the lowest extra a drafted row cost, 3 ms"
    assert not payoff.pays(8, None, 10) and not payoff.pays(8, 1, 11)
    for _ in range(10):  # the text repeats now: every draft accepted, at one row
        payoff.observe(1, 0.005, drafted=1, accepted=4)
    assert 3.0 < payoff.accepted < 4.0
    assert payoff.pays(8, None, 12), "it could pay at eight rows now"
    payoff.observe(8, 0.014, drafted=1, accepted=4)
    assert payoff.break_even(8, 1) == pytest.approx(6.0) and not payoff.pays(8, 1, 13)
    payoff.observe(8, 0.024, drafted=8, accepted=32)
    assert payoff.break_even(8, 8) == pytest.approx(2.0) and payoff.pays(8, 8, 14)


def test_mtp_drafts_are_the_heads_proposal_after_exactly_the_known_tokens() -> None:
    """--speculative-method mtp: a request drafts what the runner's MTP head proposed after its tokens of
    the last step (StepOutput.proposals), cut to the grant; a request in flight counts k ready (its
    proposal comes with its token); rows ask the head for k drafts, 0 while backing off or above the
    row limit, -1 for a request that never drafts."""
    spec = Speculator(3, 2, 4, max_rows=2, page_size=16, method="mtp")
    request = make_request("r", [5, 6, 7])
    request.output_token_ids.append(9)
    request.num_computed_tokens = 3
    assert spec.propose(request, 3) == []  # nothing proposed yet
    row = Row(request, Slice("r", 1, False, False), SequenceChunk((9,), 3, (), 0), True, ())
    spec.proposed([row], [(0, (1, 2, 3))])
    assert (request.mtp_drafts, request.mtp_drafts_at) == ((1, 2, 3), 4)
    assert spec.propose(request, 3) == [1, 2, 3] and spec.propose(request, 2) == [1, 2]
    request.output_token_ids.append(8)
    assert spec.propose(request, 3) == []  # a proposal after other tokens: stale
    request.output_token_ids.pop()
    state = request.sched_state()
    assert spec.with_drafts((state,), [request])[0].num_draft_tokens == 3
    request.num_computed_tokens = 4  # its newest token is in the step in flight
    assert spec.with_drafts((request.sched_state(),), [request])[0].num_draft_tokens == 3
    assert spec.head_drafts(request, 2) == 3 and spec.head_drafts(request, 3) == -1  # above the row limit: off
    scoring = make_request("p", [5, 6])
    scoring.scoring = True
    assert spec.head_drafts(scoring, 1) == -1
    spec.verified(request, Verified(0, 3, (), (), ()))  # every draft rejected: backs off
    assert spec.head_drafts(request, 1) == 0 and spec.propose(request, 3) == []
    assert Speculator(3, 2, 4, max_rows=2, page_size=16).head_drafts(request, 1) == -1  # prompt lookup
    spec.step = 100
    spec.payoff.observe(1, 0.002, drafted=0, accepted=0)
    spec.payoff.observe(1, 0.012, drafted=1, accepted=0)
    assert not spec.payoff.pays(1, 1, spec.step) and spec.head_drafts(request, 1) == -1  # where it does not pay: off


def test_a_drafting_row_gets_pages_for_the_heads_chain_from_what_the_step_left() -> None:
    """prepare's chain room (gpu_worker.engine.prepare._chain_room): pages past the chunk for k - 1 chained
    positions, only from free pages (a row that finds none keeps its own and drafts as far as they reach)."""
    pool = KVPagePool(4, 4, 1, 1, 2, torch.float32, torch.device("cpu"))
    a, b = make_request("a", list(range(7))), make_request("b", list(range(7)))
    a.page_ids, b.page_ids = pool.allocate(2), pool.allocate(1)
    chunk = SequenceChunk((6,), 6, tuple(a.page_ids), 0, mtp_drafts=4)
    rows = [
        Row(a, Slice("a", 1, False, False), chunk, True, ()),
        Row(b, Slice("b", 1, False, False), chunk._replace(mtp_drafts=0), True, ()),
    ]

    class _Allocator:
        kv_pool = pool

    _chain_room(rows, _Allocator(), 4)  # type: ignore[arg-type]
    assert len(a.page_ids) == 3 and rows[0].chunk.page_ids == tuple(a.page_ids)  # positions up to 9: 3 pages
    assert len(b.page_ids) == 1 and rows[1].chunk.mtp_drafts == 0
    c = make_request("c", list(range(7)))
    c.page_ids = []
    rows = [Row(c, Slice("c", 1, False, False), chunk._replace(start_pos=12), True, ())]  # needs 4 pages, 0 free
    _chain_room(rows, _Allocator(), 4)  # type: ignore[arg-type]
    assert c.page_ids == [] and pool.num_free_pages == 0
