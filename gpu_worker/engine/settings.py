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
    # speculative decoding (gpu_worker/engine/speculation.py): drafts per decode at most; 0 = off
    num_speculative_tokens: int = 0
    # where drafts come from: ngram (prompt lookup) | mtp (the checkpoint's multi-token-prediction head)
    speculative_method: str = "ngram"
    ngram_min: int = 2  # prompt lookup: the shortest suffix match that drafts
    ngram_max: int = 4  # ... and the longest one tried
    # steps of more running requests decode without drafts (bench_spec); 0 = auto: COMPILED_SPECULATIVE_ROWS
    # where verify steps have compiled programs (prompt lookup on CPU with --compile-step-sizes: the largest
    # bucket up to that many), else SPECULATIVE_ROWS (speculative_rows; EngineSettings built directly: the latter)
    speculative_max_rows: int = 0
    # measure whether a step's drafts pay and stop drafting where they do not (speculation.Payoff); off:
    # draft whenever there are drafts (what a timing-independent test, or a benchmark of the raw path, wants)
    speculative_payoff: bool = True

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
        self._check_speculation()
        for name in ("max_queue_len", "default_max_tokens"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {getattr(self, name)}")

    def _check_speculation(self) -> None:
        k = self.num_speculative_tokens
        if k < 0:
            raise InvalidArgumentError(f"--num-speculative-tokens must be >= 0 (0 = off), got {k}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise InvalidArgumentError(
                f"--speculative-method {self.speculative_method!r} is not supported; use one of"
                f" {', '.join(SPECULATIVE_METHODS)}"
            )
        mtp = k if self.speculative_method == "mtp" else 0
        if self.runner.mtp_draft_tokens != mtp:
            raise InvalidArgumentError(
                f"--speculative-method {self.speculative_method} with --num-speculative-tokens {k} needs the"
                f" runner's mtp_draft_tokens = {mtp}, got {self.runner.mtp_draft_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidArgumentError(
                f"--ngram-min {self.ngram_min} and --ngram-max {self.ngram_max}: need 1 <= min <= max"
            )
        if self.speculative_max_rows < 0:
            raise InvalidArgumentError(
                f"--speculative-max-rows must be >= 0 (0 = auto), got {self.speculative_max_rows}"
            )
        if self.speculative_max_rows == 0:
            object.__setattr__(self, "speculative_max_rows", SPECULATIVE_ROWS)
        if k and self.runner.num_draft_rows < k:
            raise InvalidArgumentError(
                f"--num-speculative-tokens {k} needs the runner's draft rows (RunnerConfig.num_draft_rows ="
                f" {self.runner.num_draft_rows}) to hold at least {k}: set num_draft_rows ="
                " num_speculative_tokens * speculative_max_rows (draft_rows_for)"
            )


SPECULATIVE_METHODS = ("ngram", "mtp")


SPECULATIVE_ROWS = 4  # an eager verify step of 8 rows cost 35 ms against 8.7 for a plain one (bench/RESULTS.md)
COMPILED_SPECULATIVE_ROWS = 8  # compiled verify programs: 8 clients drafting gave 1.94x on a greedy loop


def speculative_rows(max_rows: int, method: str, compiled_buckets: tuple[int, ...]) -> int:
    """--speculative-max-rows with 0 (auto) resolved: where prompt lookup's verify steps have compiled
    programs (`compiled_buckets`, RunnerConfig.compile_step_sizes parsed), the largest bucket up to
    COMPILED_SPECULATIVE_ROWS, else SPECULATIVE_ROWS (the MTP head's steps go through the programs too, but
    the head's own cost per row comes on top, and 8 drafting rows with it were not measured)."""
    if max_rows:
        return max_rows
    fitting = [b for b in compiled_buckets if b <= COMPILED_SPECULATIVE_ROWS]
    return max(fitting) if method == "ngram" and fitting else SPECULATIVE_ROWS


def draft_rows_for(num_speculative_tokens: int, max_rows: int) -> int:
    """RunnerConfig.num_draft_rows for these settings: a kept state per draft token of every drafting row."""
    return num_speculative_tokens * max_rows
