"""The prefill compute share: prefill gets a target share of the engine's service time while both
prefill and decode are runnable, and the planner turns that into each mixed step's prefill budget.

The planner keeps nothing between steps, so the accounting lives in the worker and travels in every
step input (`ShareState`); the functions here are the whole policy, pure, on both sides: the worker
advances the state after each step it ran (`next_share`: decay, charge, steer), the planner reads it
(`share_budget_tokens`). A recorded input therefore replays to the same plan.

    service time     a step's wall time, split between the classes by the step-time cost model
                     (seconds per prefill token, per decode row, per forward), charged only to steps
                     in which both classes were runnable, decayed with a half-life
    share            prefill / (prefill + decode) of that decayed time
    target           FIXED: the config's share. AUTO: steered towards the classes' backlog (the
                     pending prefill's estimated seconds against the running decodes'), within
                     [min, max], unmoved inside the deadband, at most slew_per_s a second
    budget           the prefill tokens after which this step's share would reach the target, in
                     quanta; at least one quantum while prefill is below its target (so a share can
                     never round prefill down to nothing), ties to decode

The token budget (max_num_batched_tokens, and micro-slicing's when it is on too) and request priority
stay authoritative: the share only lowers a mixed step's prefill budget.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hybridserve.errors import InvalidArgumentError

if TYPE_CHECKING:  # config.py and state.py import this module
    from scheduler_svc.core.config import SchedulerConfig
    from scheduler_svc.core.state import StepInput


class PrefillShareMode(enum.IntEnum):
    """How a mixed step's prefill budget follows the service time (values match the wire enum)."""

    OFF = 0  # no share: the token budgets alone
    FIXED = 1  # the target is SchedulerConfig.prefill_share
    AUTO = 2  # the target follows the backlog, bounded, with a deadband and a slew limit


@dataclass(frozen=True, slots=True)
class ShareState:
    """The worker's accounting, sent with every step while a share mode is on. Times in seconds."""

    prefill_service_s: float = 0.0  # decayed service time charged to prefill (both classes runnable)
    decode_service_s: float = 0.0  # the same for decode
    target: float = 0.5  # the share prefill is steered to now
    prefill_token_s: float = 1e-4  # cost model: step seconds per prefill token
    decode_row_s: float = 2.5e-4  # per decode row
    forward_s: float = 2e-3  # per forward, whatever it computes

    @property
    def share(self) -> float:
        """Prefill's part of the decayed service time; 0 before anything was charged."""
        total = self.prefill_service_s + self.decode_service_s
        return self.prefill_service_s / total if total > 0 else 0.0

    def validate(self) -> ShareState:
        for name in ("prefill_service_s", "decode_service_s", "target", "prefill_token_s", "decode_row_s", "forward_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise InvalidArgumentError(f"share.{name} = {value} must be a finite number >= 0")
        if self.target >= 1.0:
            raise InvalidArgumentError(f"share.target = {self.target} must be < 1 (decode keeps some service)")
        if self.prefill_token_s <= 0:
            raise InvalidArgumentError(f"share.prefill_token_s = {self.prefill_token_s} must be > 0")
        return self


@dataclass(frozen=True, slots=True)
class StepCost:
    """One executed step, as the accounting sees it."""

    wall_s: float  # how long the step took
    num_prefill_tokens: int
    num_decode_rows: int
    prefill_runnable: bool  # some prefill was pending when the step was planned
    decode_runnable: bool  # some request was decoding


def decode_seconds(state: ShareState, num_decode_rows: int) -> float:
    """What a step's decode part costs by the model: the forward and its rows."""
    return state.forward_s + state.decode_row_s * num_decode_rows if num_decode_rows else 0.0


def share_budget_tokens(state: ShareState, num_decode_rows: int, quantum: int) -> int:
    """The prefill tokens a step with `num_decode_rows` decodes may take: those after which prefill's
    share of the service time would reach the target,

        (P + x) = target * (P + D + d + x)   =>   x = (target * (P + D + d) - P) / (1 - target)

    (P, D: the decayed prefill and decode time; d: this step's decode part; x: its prefill part), in
    tokens at the cost model's seconds per token. While prefill is below its target (strictly: ties
    go to decode), at least one quantum. The planner splits it among the prefills in quanta; a part
    below a quantum can still finish a short prompt (rules.quanta_offer)."""
    target = state.target
    prefill, decode = state.prefill_service_s, state.decode_service_s
    d = decode_seconds(state, num_decode_rows)
    seconds = (target * (prefill + decode + d) - prefill) / (1.0 - target)
    ratio = max(seconds, 0.0) / state.prefill_token_s  # may be inf for a tiny (yet valid) cost per token
    tokens = int(ratio) if ratio < 1 << 40 else 1 << 40
    total = prefill + decode
    below = prefill < target * total if total > 0 else target > 0
    if below:
        tokens = max(tokens, quantum)
    return tokens


def mixed_prefill_cap(config: SchedulerConfig, state: ShareState | None, num_decodes: int) -> int | None:
    """The prefill budget of a step that carries decodes, tokens: micro-slicing's, the compute share's
    (share_budget_tokens), or the smaller of the two; None when neither applies (no decode in the
    step, or both off): the step then plans as plain chunked prefill. A step input without the
    accounting counts as nothing charged yet, at the config's share."""
    if not num_decodes:
        return None
    cap = config.max_num_prefill_tokens_per_step or None
    if config.has_prefill_share:
        by_share = share_budget_tokens(state or ShareState(target=config.prefill_share), num_decodes, config.quantum)
        cap = by_share if cap is None else min(cap, by_share)
    return cap


def decayed(state: ShareState, elapsed_s: float, half_life_s: float) -> ShareState:
    """Both service times after `elapsed_s` seconds of exponential decay."""
    factor = 0.5 ** (max(elapsed_s, 0.0) / half_life_s)
    return replace(state, prefill_service_s=state.prefill_service_s * factor,
                   decode_service_s=state.decode_service_s * factor)  # fmt: skip


def charged(state: ShareState, cost: StepCost) -> ShareState:
    """The step's wall time added to each class by the cost model's split, when both were runnable
    (a class alone is owed nothing: it ran because the other had nothing to do)."""
    if not (cost.prefill_runnable and cost.decode_runnable) or cost.wall_s <= 0:
        return state
    prefill_model = state.prefill_token_s * cost.num_prefill_tokens
    decode_model = decode_seconds(state, cost.num_decode_rows)
    modelled = prefill_model + decode_model
    if modelled <= 0:
        return state
    prefill_part = cost.wall_s * prefill_model / modelled
    return replace(state, prefill_service_s=state.prefill_service_s + prefill_part,
                   decode_service_s=state.decode_service_s + cost.wall_s - prefill_part)  # fmt: skip


def backlog_share(state: ShareState, prefill_tokens_pending: int, decode_tokens_left: tuple[int, ...]) -> float | None:
    """Prefill's part of the work waiting, in model seconds: the pending prompt tokens against the
    running decodes' remaining tokens (a row each, the forward per step of the longest); None when
    neither class has any."""
    prefill = state.prefill_token_s * prefill_tokens_pending
    decode = state.decode_row_s * sum(decode_tokens_left) + state.forward_s * max(decode_tokens_left, default=0)
    total = prefill + decode
    return prefill / total if total > 0 else None


def steered(
    target: float, desired: float | None, elapsed_s: float, low: float, high: float, deadband: float, slew_per_s: float
) -> float:
    """AUTO's target after `elapsed_s` seconds: towards `desired` (clamped to [low, high]) by at most
    slew_per_s a second, until it is within the deadband of it (then it stays: small changes in the
    backlog move nothing); always within the bounds."""
    target = min(max(target, low), high)
    if desired is None:
        return target
    goal = min(max(desired, low), high)
    gap = goal - target
    if abs(gap) <= deadband:
        return target
    step = min(abs(gap) - deadband, slew_per_s * max(elapsed_s, 0.0))
    return min(max(target + math.copysign(step, gap), low), high)


def pending_work(step: StepInput) -> tuple[int, tuple[int, ...]]:
    """(prompt tokens still to prefill, each running decode's tokens left) of a step input: the
    backlog AUTO steers by."""
    prefill = sum(r.num_prefill_tokens_left for r in step.running + step.waiting)
    decodes = tuple(r.max_tokens - r.num_output_tokens for r in step.running if not r.is_prefill)
    return prefill, decodes


def next_share(
    state: ShareState, config: SchedulerConfig, step: StepInput, cost: StepCost, elapsed_s: float
) -> ShareState:
    """The accounting after one executed step (`step`: what it was planned from; `elapsed_s`: since
    the previous update): decayed, the step charged, and the target set (FIXED) or steered (AUTO).
    The worker calls this after every step and sends the result with the next."""
    state = charged(decayed(state, elapsed_s, config.prefill_share_half_life_s), cost)
    if config.prefill_share_mode == PrefillShareMode.AUTO:
        prefill_left, decodes_left = pending_work(step)
        desired = backlog_share(state, prefill_left, decodes_left)
        target = steered(state.target, desired, elapsed_s, config.prefill_share_min, config.prefill_share_max,
                         config.prefill_share_deadband, config.prefill_share_slew_per_s)  # fmt: skip
    else:
        target = config.prefill_share
    return replace(state, target=target)
