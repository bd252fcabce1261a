"""The engine's side of speculative decoding (gpu_worker.engine.speculation), one layer at a time: prompt
lookup, who drafts, the back-off, the page reserve, and the settings' checks. The verification and the
state rollback are the runner's (tests/model/test_speculation_runner.py); served end to end in
tests/model/test_speculation_serving.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gpu_worker.engine.request import GenerationParams, Request, StopChecker
from gpu_worker.engine.settings import EngineSettings, draft_rows_for
from gpu_worker.engine.speculation import MAX_BACKOFF_STEPS, Payoff, Speculator, propose_ngram
from gpu_worker.runner.protocol import SamplingParams, Verified
from gpu_worker.runner.settings import RunnerConfig
from hybridserve.errors import InvalidArgumentError
from scheduler_svc.core import SchedulerConfig


def ngram(tokens: list[int], k: int = 4, lo: int = 2, hi: int = 4) -> list[int]:
    return propose_ngram(np.array(tokens, dtype=np.int64), k, lo, hi)


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


def test_requests_whose_controls_read_their_history_never_draft() -> None:
    spec = Speculator(4, 2, 4, max_rows=4, page_size=16)
    assert spec.propose(make_request("a", LOOP), len(LOOP), 4) == [7, 8, 9, 7]
    assert spec.propose(make_request("b", LOOP, presence_penalty=0.5), len(LOOP), 4) == []
    assert spec.propose(make_request("c", LOOP, min_tokens=3, held_token_ids=(0,)), len(LOOP), 4) == []
    assert spec.propose(make_request("d", LOOP), len(LOOP), 2) == [7, 8]  # the limit cuts
    assert spec.propose(make_request("e", LOOP), len(LOOP), 0) == []


def test_a_request_whose_drafts_all_miss_backs_off_doubling_up_to_the_cap() -> None:
    spec = Speculator(4, 2, 4, max_rows=4, page_size=16)
    request = make_request("r", LOOP)
    pauses = []
    for _ in range(6):
        spec.verified(request, Verified(0, 4, (), (), ()))
        start = spec.step
        while not spec.propose(request, len(LOOP), 4):
            spec.step += 1
        pauses.append(spec.step - start)
    assert pauses == [2, 4, 8, 16, MAX_BACKOFF_STEPS, MAX_BACKOFF_STEPS]
    spec.verified(request, Verified(0, 4, (7,), (0.0,), ((),)))  # an accepted draft resets it
    spec.verified(request, Verified(0, 4, (), (), ()))
    start = spec.step
    while not spec.propose(request, len(LOOP), 4):
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
        return EngineSettings(
            scheduler=SchedulerConfig(), runner=RunnerConfig(num_draft_rows=rows), scheduler_addresses=("x:1",),
            **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    assert settings(num_speculative_tokens=4).num_speculative_tokens == 4
    with pytest.raises(InvalidArgumentError, match="num-speculative-tokens must be >= 0"):
        settings(num_speculative_tokens=-1)
    with pytest.raises(InvalidArgumentError, match="speculative-method 'mtp' is not supported"):
        settings(num_speculative_tokens=4, speculative_method="mtp")
    with pytest.raises(InvalidArgumentError, match="ngram-min 3 and --ngram-max 2"):
        settings(num_speculative_tokens=4, ngram_min=3, ngram_max=2)
    with pytest.raises(InvalidArgumentError, match="draft rows"):
        settings(num_speculative_tokens=4, draft_rows=2)


def test_drafting_stops_where_its_steps_cost_more_than_they_yield_and_is_tried_again_later() -> None:
    payoff = Payoff()
    assert payoff.pays(1, 0), "unmeasured: tried"
    payoff.observe(1, 0.002, drafted=False, accepted=0)
    payoff.observe(1, 0.012, drafted=True, accepted=4)  # 5 tokens for 6 plain steps' time
    tries = [step for step in range(2000) if payoff.pays(1, step)]
    assert tries == [16, 48, 112, 240, 496, 1008, 2032][: len(tries)] and len(tries) == 6
    payoff.observe(2, 0.003, drafted=False, accepted=0)
    payoff.observe(2, 0.006, drafted=True, accepted=6)  # 4 tokens a row for two plain steps' time
    assert all(payoff.pays(2, step) for step in range(100))
