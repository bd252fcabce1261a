"""The engine keeps the prefill compute share's accounting (gpu_worker/engine/planning.py,
ShareAccountant) and sends it with every step input; the plans then follow it. The fake runner of
test_engine_core, a slow forward so that steps have a wall time to charge."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpu_worker.engine.planning import ShareAccountant
from gpu_worker.runner.step_split import DECODE_ROW_TOKENS, FORWARD_FIXED_TOKENS
from scheduler_svc.core import PrefillShareMode, StepInput, StepPlan, plan_step
from tests.worker.test_engine_core import CONFIG, FakeRunner, request, start_engine, stream, tokens_of  # noqa: F401

SHARED = replace(CONFIG, max_num_prefill_tokens_per_step=0, prefill_share_mode=PrefillShareMode.FIXED,
                 prefill_share=0.25)  # fmt: skip


def test_the_accountant_learns_the_cost_model_and_charges_mixed_steps_only() -> None:
    accountant = ShareAccountant(SHARED.validate())
    assert accountant.state is not None and accountant.state.target == 0.25
    step = StepInput(SHARED, (), (), 0, 100, accountant.state)
    plan = plan_step(step)
    mixed = replace(plan, stats=replace(plan.stats, num_pending_prefills=1))
    decode_units = FORWARD_FIXED_TOKENS + DECODE_ROW_TOKENS * 4
    # a decode-only step teaches the decode part: 28 units in 5.6 ms
    accountant.step_finished(step, plan, prefill_tokens=0, decode_rows=4, service_s=0.0056, end_time_s=1.0)
    state = accountant.state
    assert state.forward_s == pytest.approx(FORWARD_FIXED_TOKENS * 0.0056 / decode_units)
    assert state.decode_row_s == pytest.approx(DECODE_ROW_TOKENS * 0.0056 / decode_units)
    assert state.prefill_service_s == state.decode_service_s == 0.0  # no prefill pending: nothing charged
    # a mixed step: what its decode part leaves, over its prefill tokens
    accountant.step_finished(step, mixed, prefill_tokens=100, decode_rows=4, service_s=0.0256, end_time_s=1.03)
    state = accountant.state
    assert state.prefill_token_s == pytest.approx((0.0256 - 0.0056) / 100)
    assert state.prefill_service_s == pytest.approx(0.02, rel=1e-6)  # its part, by the model
    assert state.prefill_service_s + state.decode_service_s == pytest.approx(0.0256)
    assert ShareAccountant(CONFIG).state is None  # no share mode, no accounting


def test_the_engine_sends_its_accounting_and_plans_follow_it(start_engine) -> None:  # noqa: F811
    seen: list[StepInput] = []

    def plan(step: StepInput) -> StepPlan:
        seen.append(step)
        return plan_step(step)

    runner = FakeRunner(num_pages=256)
    runner.delay_s = 0.002
    engine, runner, log = start_engine(runner, plan, scheduler=SHARED.validate(), async_scheduling=False)
    decodes = [request(f"d{i}", 4, 40) for i in range(2)]
    for r in decodes:
        engine.submit(r)
    for r in decodes:
        r.events.get(timeout=20)  # each has its first token: decoding
    long = request("long", 120, 2)
    engine.submit(long)
    assert len(tokens_of(stream(long))) == 2
    for r in decodes:
        assert len(tokens_of(stream(r))) == 39
    shared = [s for s in seen if s.share is not None]
    assert shared and len(shared) == len(seen), "every step input carries the accounting"
    assert seen[-1].share.prefill_service_s > 0 and seen[-1].share.decode_service_s > 0
    mixed = [r for r in log.steps if r.num_decode_tokens and r.num_prefill_tokens]
    assert mixed, "the long prompt ran beside the decodes"
    for record in mixed:
        assert record.num_prefill_tokens <= record.plan.stats.prefill_budget_tokens
