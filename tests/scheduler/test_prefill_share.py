"""The prefill compute share (scheduler_svc/core/share.py): its rules one by one, and a simulated
engine (a synthetic step-time cost model, the planner's plans fed back, the accounting advanced after
each step as the worker does) in which a fixed target is reached within 10% and the automatic target
keeps its bounds, deadband and slew."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest

from hybridserve.errors import InvalidArgumentError
from scheduler_svc import convert
from scheduler_svc.core import PrefillShareMode, RequestState, ShareState, StepInput, plan_step
from scheduler_svc.core.share import StepCost, charged, decayed, next_share, share_budget_tokens, steered
from scheduler_svc.service import plan_request
from tests.scheduler.helpers import config, decode, prefill
from tests.scheduler.invariants import check_plan

# The synthetic machine: a forward costs 2 ms, a decode row 0.25 ms more, a prefill token 0.1 ms.
FORWARD_S, ROW_S, TOKEN_S = 2e-3, 2.5e-4, 1e-4
COSTS = ShareState(prefill_token_s=TOKEN_S, decode_row_s=ROW_S, forward_s=FORWARD_S)


def test_below_its_target_prefill_gets_at_least_a_quantum_and_ties_go_to_decode() -> None:
    starved = replace(COSTS, prefill_service_s=0.0, decode_service_s=10.0, target=0.3)
    assert share_budget_tokens(starved, 8, 256) >= 256
    at_target = replace(COSTS, prefill_service_s=3.0, decode_service_s=7.0, target=0.3)
    # exactly at the target: the step's own decode part (4 ms) buys prefill 0.3/0.7 of it, under a
    # quantum (enough to finish a short prompt), with no quantum of its own
    assert (
        share_budget_tokens(at_target, 8, 256)
        == share_budget_tokens(at_target, 8, 1)
        == int(0.3 * 0.004 / 0.7 / TOKEN_S)
    )
    ahead = replace(COSTS, prefill_service_s=9.0, decode_service_s=1.0, target=0.3)
    assert share_budget_tokens(ahead, 8, 1) == 0
    assert share_budget_tokens(replace(starved, prefill_token_s=5e-324), 8, 256) == 1 << 40  # no overflow
    fresh = replace(COSTS, target=0.3)  # nothing charged yet: below a positive target
    assert share_budget_tokens(fresh, 8, 256) == 256 and share_budget_tokens(replace(fresh, target=0.0), 8, 256) == 0


def test_charging_splits_a_step_by_the_cost_model_and_only_when_both_classes_are_runnable() -> None:
    cost = StepCost(wall_s=0.02, num_prefill_tokens=100, num_decode_rows=8, prefill_runnable=True, decode_runnable=True)
    state = charged(COSTS, cost)  # model: prefill 10 ms, decode 4 ms -> 20 ms split 10:4
    assert state.prefill_service_s == pytest.approx(0.02 * 10 / 14)
    assert state.decode_service_s == pytest.approx(0.02 * 4 / 14)
    assert charged(COSTS, replace(cost, prefill_runnable=False)) == COSTS
    assert charged(COSTS, replace(cost, decode_runnable=False)) == COSTS
    halved = decayed(replace(COSTS, prefill_service_s=4.0, decode_service_s=2.0), 2.0, 2.0)
    assert (halved.prefill_service_s, halved.decode_service_s) == (2.0, 1.0)


def test_steering_keeps_the_bounds_the_deadband_and_the_slew() -> None:
    assert steered(0.5, 0.55, 10.0, 0.2, 0.8, 0.1, 0.05) == 0.5  # within the deadband: stays
    assert steered(0.5, 0.9, 1.0, 0.2, 0.8, 0.1, 0.05) == pytest.approx(0.55)  # a second of slew towards 0.8
    assert steered(0.5, 0.9, 100.0, 0.2, 0.8, 0.1, 0.05) == pytest.approx(0.7)  # the deadband short of the bound
    assert steered(0.5, 0.9, 100.0, 0.2, 0.8, 0.0, 0.05) == 0.8  # no deadband: the bound, not the backlog's 0.9
    assert steered(0.5, 0.0, 2.0, 0.2, 0.8, 0.1, 0.05) == pytest.approx(0.4)
    assert steered(0.95, None, 1.0, 0.2, 0.8, 0.1, 0.05) == 0.8  # no backlog: only the bounds apply


def test_the_share_fields_are_validated_and_travel_on_the_wire() -> None:
    cfg = config(prefill_share_mode=PrefillShareMode.AUTO)
    with pytest.raises(InvalidArgumentError, match="prefill_share_max"):
        replace(cfg, prefill_share_max=1.5).validate()
    with pytest.raises(InvalidArgumentError, match="micro_slice_long_prompts_only"):
        replace(cfg, micro_slice_long_prompts_only=True).validate()
    with pytest.raises(InvalidArgumentError, match="share.prefill_token_s"):
        plan_step(StepInput(cfg, (decode("d0"),), (), 0, 100, replace(COSTS, prefill_token_s=0)))
    s = StepInput(cfg, (decode("d0"), prefill("p0", 5000)), (), 3, 10_000, replace(COSTS, decode_service_s=1.0))
    for msg in (convert.step_to_pb(s), convert.step_to_pb_columns(s)):
        assert convert.step_from_pb(msg) == s
        assert plan_request(msg) == plan_step(s)  # the recorded input replays to the same plan


@dataclass
class Engine:
    """A closed loop around the planner: 8 decodes with 100,000 tokens to go, the given prompts, each
    step's wall time from the synthetic model, the accounting advanced after each step."""

    cfg: object
    state: ShareState
    clock_s: float = 0.0
    prefill_s: float = 0.0  # undecayed totals over the steps where both classes were runnable
    decode_s: float = 0.0

    def run(self, steps: int, prompts: list[RequestState], targets: list[float] | None = None) -> None:
        decodes = [RequestState(f"d{i}", 100, 100 + i, 1 + i, 100_000, 0, -1.0) for i in range(8)]
        for index in range(steps):
            s = StepInput(self.cfg, tuple(decodes + prompts), (), index, 10**9, self.state)  # type: ignore[arg-type]
            plan = plan_step(s)
            check_plan(s, plan)
            served = {sl.request_id: sl.num_tokens for sl in plan.slices if sl.is_prefill}
            prefill_part = TOKEN_S * sum(served.values())
            decode_part = FORWARD_S + ROW_S * len(decodes)
            wall = prefill_part + decode_part
            self.clock_s += wall
            self.prefill_s += prefill_part
            self.decode_s += decode_part
            cost = StepCost(wall, sum(served.values()), len(decodes), True, True)
            self.state = next_share(self.state, self.cfg, s, cost, wall)  # type: ignore[arg-type]
            if targets is not None:
                targets.append(self.state.target)
            prompts = [
                p._replace(num_computed_tokens=p.num_computed_tokens + served.get(p.request_id, 0)) for p in prompts
            ]
            decodes = [
                d._replace(num_computed_tokens=d.num_computed_tokens + 1, num_output_tokens=d.num_output_tokens + 1)
                for d in decodes
            ]

    @property
    def achieved(self) -> float:
        return self.prefill_s / (self.prefill_s + self.decode_s)


@pytest.mark.parametrize("target", [0.2, 0.35, 0.5, 0.7])
@pytest.mark.parametrize("grid", [(16, 16), (256, 64)])
def test_a_fixed_target_is_reached_within_ten_percent(target: float, grid: tuple[int, int]) -> None:
    block, mamba = grid
    cfg = config(max_num_batched_tokens=4096, max_num_seqs=16, max_num_prefill_tokens_per_step=0, block_size=block,
                 mamba_block_size=mamba, prefill_share_mode=PrefillShareMode.FIXED,
                 prefill_share=target).validate()  # fmt: skip
    engine = Engine(cfg, replace(COSTS, target=target))
    prompts = [prefill(f"p{i}", 10**7, arrival=float(i)) for i in range(3)]
    engine.run(200, prompts)  # warm-up: the decayed accounting forgets where it started
    engine.prefill_s = engine.decode_s = 0.0
    engine.run(600, prompts)
    assert abs(engine.achieved - target) <= 0.1 * target, (engine.achieved, target)


def test_the_automatic_target_follows_the_backlog_within_its_bounds_deadband_and_slew() -> None:
    cfg = config(max_num_batched_tokens=4096, max_num_seqs=16, max_num_prefill_tokens_per_step=0, block_size=16,
                 mamba_block_size=16, prefill_share_mode=PrefillShareMode.AUTO,
                 prefill_share=0.5).validate()  # fmt: skip
    targets: list[float] = [0.5]
    engine = Engine(cfg, replace(COSTS, target=0.5))
    engine.run(3000, [prefill("huge", 10**9)], targets)  # prefill's backlog dwarfs the decodes': up to the max
    top = cfg.prefill_share_max - cfg.prefill_share_deadband  # it stops within the deadband of its goal
    assert max(targets) <= cfg.prefill_share_max and math.isclose(targets[-1], top)
    engine.run(3000, [], targets)  # no prefill backlog: down to the min
    bottom = cfg.prefill_share_min + cfg.prefill_share_deadband
    assert min(targets) >= cfg.prefill_share_min and math.isclose(targets[-1], bottom)
    steps_s = FORWARD_S + ROW_S * 8 + 4096 * TOKEN_S  # the longest a simulated step can take
    moves = [abs(b - a) for a, b in zip(targets, targets[1:], strict=False)]
    assert max(moves) <= cfg.prefill_share_slew_per_s * steps_s + 1e-12  # the slew per step's seconds
    assert len(set(targets[-100:])) == 1  # at a bound, within the deadband of the backlog's share: still


def test_a_recorded_step_with_its_accounting_replays_to_the_same_plan(tmp_path) -> None:
    import json

    from scheduler_svc.replay import replay_file
    from scheduler_svc.step_records import step_line

    cfg = config(prefill_share_mode=PrefillShareMode.AUTO)
    s = StepInput(cfg, (decode("d0"), prefill("p0", 9000)), (), 5, 10_000, replace(COSTS, decode_service_s=2.0))
    line, _ = step_line(5, s, plan_step(s), 0.001)
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (replayed,) = replay_file(path)
    budget = convert.plan_from_pb(replayed.replayed).stats.prefill_budget_tokens
    assert replayed.is_identical and 0 < budget <= share_budget_tokens(s.share, 1, cfg.quantum)
