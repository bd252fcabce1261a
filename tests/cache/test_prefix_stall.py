"""Waiting requests whose cached prefixes pin the KV pool must not stall the engine: the engine with
the pure planner, a real tiny model and real pools, the local prefix-cache tier on.

Two prefixes are cached, filling all but one page of the pool. Two requests that extend them are
queued in the same step, so each pins its prefix's pages while it waits, and neither can be admitted
with the one free page. The step input tells the planner which pages those hits pin, so its plan
gives up the later request's hit and admits the head request in the same step: no step plans
nothing, and the engine only applies what the plan says."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpu_worker.cache.manager import PrefixCacheManager
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.observer import EngineObserver
from gpu_worker.engine.records import StepRecord
from gpu_worker.engine.request import FinishReason, GenerationParams, Request, RequestOutput, StopChecker
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.sampling import SamplingParams
from gpu_worker.runner.settings import RunnerConfig
from scheduler_svc.core import plan_step
from tests.worker.conftest import SCHEDULER, budget_for_pages, hf_greedy, prompt_of

CONFIG = replace(SCHEDULER, stop_at_last_boundary=True)
PAGE = CONFIG.kv_page_size
BLOCK = CONFIG.block_size
NUM_PAGES = 17  # two cached 2-block prefixes (8 pages each) and one page free
DEADLINE_S = 20.0


class Steps(EngineObserver):
    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def step_finished(self, record: StepRecord) -> None:
        self.records.append(record)


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    now = time.monotonic()
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        params=GenerationParams(SamplingParams(), max_tokens, ignore_eos=True),
        arrival_time=now,
        deadline=now + DEADLINE_S,
        stop_checker=StopChecker(None, ()),
    )


def outputs(request: Request) -> list[RequestOutput]:
    events = [request.events.get(timeout=2 * DEADLINE_S)]
    while events[-1].finish_reason is None and events[-1].error is None:
        events.append(request.events.get(timeout=2 * DEADLINE_S))
    return events


@pytest.fixture
def engine(checkpoint: Path) -> Iterator[tuple[Engine, Steps]]:
    runner_config = RunnerConfig(
        memory_budget_bytes=16 << 20, kv_page_size_tokens=PAGE, max_num_seqs=CONFIG.max_num_seqs,
        num_checkpoint_slots=16, device="cpu", dtype="float32",
    )  # fmt: skip
    runner_config = replace(runner_config, memory_budget_bytes=budget_for_pages(runner_config, checkpoint, NUM_PAGES))
    runner = ModelRunner.from_model_dir(checkpoint, runner_config)
    assert runner.kv_pool.num_pages == NUM_PAGES
    settings = EngineSettings(scheduler=CONFIG, runner=runner_config, scheduler_addresses=("in-process",))
    steps = Steps()
    engine = Engine(
        runner,
        plan_step,
        settings,
        observer=steps,
        prefix=PrefixCacheManager(runner.pools, runner.loaded.fingerprint, BLOCK),
    )
    engine.start()
    yield engine, steps
    engine.stop()


def test_waiting_hits_that_pin_the_pool_are_given_up_instead_of_stalling(engine, hf_model):
    engine, steps = engine
    prefixes = [prompt_of(2 * BLOCK, 300 + i) for i in range(2)]
    for i, prefix in enumerate(prefixes):  # each leaves its 2 blocks (8 pages) in the local tier
        warm = make_request(f"warm-{i}", [*prefix, 5], 1)
        engine.submit(warm)
        assert outputs(warm)[-1].finish_reason is FinishReason.LENGTH
    kv_pool = engine.runner.kv_pool
    assert kv_pool.num_free_pages == 1
    assert engine.prefix.local.reclaimable_pages() == 2 * 2 * BLOCK // PAGE

    prompts = [[*prefix, *prompt_of(24, 400 + i)] for i, prefix in enumerate(prefixes)]  # 15 pages with 4 tokens
    late = [make_request(f"late-{i}", prompt, 4) for i, prompt in enumerate(prompts)]
    with engine.door.cond:  # both enter the waiting queue in one step, each pinning its cached prefix
        for request in late:
            engine.submit(request)
    results = [outputs(request) for request in late]

    for prompt, events in zip(prompts, results, strict=True):
        assert events[-1].error is None, events[-1].error
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert [t for e in events for t in e.token_ids] == hf_greedy(hf_model, prompt, 4)
    assert results[0][-1].cached_tokens == 2 * BLOCK, "the head request kept its cached prefix"
    empty = [r.step_index for r in steps.records if not r.plan.slices and not r.plan.preempted_request_ids]
    assert not empty, f"{len(empty)} steps of {len(steps.records)} planned nothing"
    drops = [r for r in steps.records if r.plan.dropped_prefix_request_ids]
    assert [r.plan.dropped_prefix_request_ids for r in drops] == [("late-1",)], "only the later hit is given up"
    pinned = {p.request_id: p.num_kv_pages for p in drops[0].step_input.pinned_kv_pages}
    assert pinned == {"late-0": 2 * BLOCK // PAGE, "late-1": 2 * BLOCK // PAGE}
    assert "late-0" in {s.request_id for s in drops[0].plan.slices}, "the head is admitted in the same step"
    assert kv_pool.num_free_pages + engine.prefix.local.reclaimable_pages() == NUM_PAGES
