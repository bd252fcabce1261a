"""Builders for scheduler tests: configs and request states with readable defaults."""

from __future__ import annotations

from dataclasses import replace

from scheduler_svc.core import MambaCacheMode, RequestState, SchedulerConfig, StepInput

# The micro-slicing livelock's deployment: 2048-token checkpoint grid, 256-token recurrent blocks.
SEED_CONFIG = SchedulerConfig(
    max_num_batched_tokens=8192,
    max_num_seqs=256,
    long_prefill_token_threshold=0,
    max_num_prefill_tokens_per_step=4096,
    block_size=2048,
    mamba_block_size=256,
    mamba_cache_mode=MambaCacheMode.ALIGN,
    kv_page_size=16,
)


def config(**overrides: object) -> SchedulerConfig:
    return replace(SEED_CONFIG, **overrides)  # type: ignore[arg-type]


def prefill(request_id: str, prompt: int, computed: int = 0, arrival: float = 0.0, priority: int = 0) -> RequestState:
    return RequestState(request_id, prompt, computed, 0, 64, priority, arrival)


def decode(
    request_id: str, prompt: int = 100, output: int = 1, arrival: float = -1.0, priority: int = 0
) -> RequestState:
    return RequestState(request_id, prompt, prompt + output - 1, output, 1024, priority, arrival)


def step(
    cfg: SchedulerConfig,
    running: list[RequestState] | tuple[RequestState, ...] = (),
    waiting: list[RequestState] | tuple[RequestState, ...] = (),
    step_index: int = 0,
    free_pages: int = 1_000_000,
) -> StepInput:
    return StepInput(cfg, tuple(running), tuple(waiting), step_index, free_pages)


def seed_step(step_index: int = 0) -> StepInput:
    """Three running 16384-token prefills plus a decode, 4096 micro-slicing budget."""
    running = [decode("d0")] + [prefill(f"p{i}", 16384, arrival=float(i)) for i in range(3)]
    return step(SEED_CONFIG, running, step_index=step_index)
