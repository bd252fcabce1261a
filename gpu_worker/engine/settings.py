"""The worker's configuration, built once at start-up from flags (and HYBRIDSERVE_* variables)."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.runner.settings import RunnerConfig
from hybridserve.errors import InvalidArgumentError
from scheduler_svc.core import SchedulerConfig


@dataclass(frozen=True, slots=True)
class EngineSettings:
    scheduler: SchedulerConfig  # sent with every PlanStep
    runner: RunnerConfig
    scheduler_addresses: tuple[str, ...]  # host:port of each scheduler replica
    cache_address: str | None = None  # cache_svc host:port, or None
    async_scheduling: bool = True  # plan step N+1 while step N runs
    max_queue_len: int = 1024  # waiting requests at most; more get RESOURCE_EXHAUSTED
    default_max_tokens: int = 256  # when a request leaves max_tokens unset
    # prompt + max_tokens at most; 0 = the checkpoint's max_position_embeddings capped by the KV pool
    # (gpu_worker.engine.admission.model_len_limit)
    max_model_len: int = 0
    scheduler_deadline_s: float = 2.0  # per PlanStep call
    scheduler_give_up_s: float = 30.0  # no replica answered for this long: fail in-flight requests
    idle_wait_s: float = 0.05  # how long the loop sleeps when there is no work

    def __post_init__(self) -> None:
        if self.scheduler.kv_page_size != self.runner.kv_page_size_tokens:
            raise InvalidArgumentError(
                f"kv_page_size {self.scheduler.kv_page_size} of the scheduler config differs from the"
                f" runner's {self.runner.kv_page_size_tokens}"
            )
        if self.scheduler.max_num_seqs > self.runner.max_num_seqs:
            raise InvalidArgumentError(
                f"max_num_seqs {self.scheduler.max_num_seqs} exceeds the runner's state slots"
                f" ({self.runner.max_num_seqs})"
            )
        if not self.scheduler_addresses:
            raise InvalidArgumentError("--scheduler needs at least one address (host:port)")
        for name in ("max_queue_len", "default_max_tokens"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {getattr(self, name)}")
