"""Hypothesis strategies for valid scheduler configs and request sets."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from scheduler_svc.core import (
    MambaCacheMode,
    PinnedPages,
    PrefillShareMode,
    RequestState,
    SchedulerConfig,
    ShareState,
    StepInput,
    rules,
)


@st.composite
def configs(draw: st.DrawFn, max_block: int = 512) -> SchedulerConfig:
    mode = draw(st.sampled_from([MambaCacheMode.ALIGN, MambaCacheMode.NONE]))
    mamba_block = draw(st.sampled_from([16, 32, 64, 128]))
    block = mamba_block * draw(st.sampled_from([1, 2, 4, 8]))
    block = min(block, max_block)
    page = draw(st.sampled_from([p for p in (1, 2, 4, 8, 16) if block % p == 0]))
    base = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(1, 4 * block)),
        max_num_seqs=draw(st.integers(1, 12)),
        long_prefill_token_threshold=draw(st.one_of(st.just(0), st.integers(1, 4 * block))),
        max_num_prefill_tokens_per_step=0,
        block_size=block,
        mamba_block_size=mamba_block,
        mamba_cache_mode=mode,
        kv_page_size=page,
        stop_at_last_boundary=draw(st.booleans()),
        micro_slice_long_prompts_only=draw(st.booleans()),
    )
    micro = draw(st.one_of(st.just(0), st.integers(1, 6).map(lambda k: k * base.quantum)))
    share_mode = draw(st.sampled_from(list(PrefillShareMode)))
    if share_mode != PrefillShareMode.OFF:  # the share counts every prefill token
        base = replace(base, prefill_share_mode=share_mode, micro_slice_long_prompts_only=False,
                       prefill_share=draw(st.floats(0.0, 0.95)))  # fmt: skip
    return replace(base, max_num_prefill_tokens_per_step=micro).validate()


@st.composite
def share_states(draw: st.DrawFn) -> ShareState:
    """Accounting as a worker sends it: any decayed service times, target and cost model."""
    seconds = st.floats(0.0, 30.0)
    return ShareState(
        prefill_service_s=draw(seconds), decode_service_s=draw(seconds), target=draw(st.floats(0.0, 0.95)),
        prefill_token_s=draw(st.floats(1e-6, 1e-2)), decode_row_s=draw(st.floats(0.0, 1e-2)),
        forward_s=draw(st.floats(0.0, 5e-2)),
    )  # fmt: skip


@st.composite
def request_states(draw: st.DrawFn, request_id: str, waiting: bool, arrival: float) -> RequestState:
    prompt = draw(st.integers(1, 3000))
    priority = draw(st.integers(0, 2))
    if waiting or draw(st.booleans()):
        computed = draw(st.integers(0, prompt - 1))
        return RequestState(request_id, prompt, computed, 0, draw(st.integers(1, 64)), priority, arrival)
    output = draw(st.integers(1, 64))
    return RequestState(
        request_id, prompt, prompt + output - 1, output, output + draw(st.integers(0, 64)), priority, arrival
    )


@st.composite
def step_inputs(draw: st.DrawFn) -> StepInput:
    config = draw(configs())
    num_running = draw(st.integers(0, config.max_num_seqs))
    num_waiting = draw(st.integers(0, 6))
    running = [draw(request_states(f"r{i}", False, float(draw(st.integers(0, 20))))) for i in range(num_running)]
    waiting = [draw(request_states(f"w{i}", True, float(draw(st.integers(0, 40))))) for i in range(num_waiting)]
    return StepInput(
        config=config,
        running=tuple(running),
        waiting=tuple(waiting),
        step_index=draw(st.integers(0, 10_000)),
        num_free_kv_pages=draw(st.one_of(st.integers(0, 64), st.integers(0, 5000))),
        share=draw(share_states()) if config.has_prefill_share and draw(st.booleans()) else None,
    )


@st.composite
def pinned_step_inputs(draw: st.DrawFn) -> StepInput:
    """Step inputs whose waiting hits pin pages (any count up to the hit's pages, or none listed),
    often with few pages free: the inputs where nothing may progress but by a remedy."""
    step = draw(step_inputs())
    page = step.config.kv_page_size
    pinned = tuple(
        PinnedPages(r.request_id, draw(st.integers(0, rules.pages_for_tokens(r.num_computed_tokens, page))))
        for r in step.waiting
        if r.num_computed_tokens > 0 and draw(st.booleans())
    )
    free = draw(st.one_of(st.just(step.num_free_kv_pages), st.integers(0, 8)))
    return replace(step, pinned_kv_pages=pinned, num_free_kv_pages=free)
