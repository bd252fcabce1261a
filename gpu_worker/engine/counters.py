"""Engine totals since start, written by the engine thread once per step."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.engine.records import StepRecord


@dataclass(slots=True)
class EngineCounters:
    """Read by GetInfo and tests from any thread (plain numbers: a stale read is harmless)."""

    num_steps: int = 0
    step_wall_seconds: float = 0.0  # whole steps: planning wait + forward + apply
    scheduler_wait_seconds: float = 0.0  # part of the above spent blocked on the scheduler
    num_preemptions: int = 0  # requests preempted (by plans, or for lack of pages)
    num_stalled_steps: int = 0
    num_generated_tokens: int = 0
    num_computed_tokens: int = 0  # tokens run through the model (prefill chunks + decodes)

    def add_step(self, record: StepRecord) -> None:
        """Adds one executed step."""
        self.num_steps += 1
        self.step_wall_seconds += record.wall_s
        self.scheduler_wait_seconds += record.plan_wait_s
        self.num_preemptions += len(record.preempted_request_ids)
        self.num_stalled_steps += int(record.plan.stats.stalled)
        self.num_computed_tokens += record.num_computed_tokens
        self.num_generated_tokens += record.num_sampled_tokens
