"""The scheduling rules, one small pure function each. The planner composes them.

Token ranges are half-open. For one request:

    [0, computed) already in the KV cache / state   [computed, prompt) prefill left   then decode

A prefill chunk is [start, end) with start = num_computed_tokens.
"""

from __future__ import annotations

import math


def holds_sub_block_exception(block_size: int, max_num_batched_tokens: int, threshold: int) -> bool:
    """True when no step budget can ever hold a whole block.

    A step computes at most max_num_batched_tokens tokens, and a single request at most
    long_prefill_token_threshold (when > 0). If even that is smaller than one block, demanding
    block-aligned chunk ends would freeze every long prefill forever, so chunks may then advance
    sub-block; they still re-align at the next boundary (a chunk never crosses one without ending
    on it).
    """
    cap = min(max_num_batched_tokens, threshold) if threshold > 0 else max_num_batched_tokens
    return block_size > cap


def quantum_tokens(is_aligned: bool, sub_block_exception: bool, block_size: int, mamba_block_size: int) -> int:
    """The unit in which a micro-sliced prefill budget is split.

    The livelock this rule prevents: with quantum lcm(mamba_block_size) = 256, a 4096 budget over
    three prefills splits 1536/1280/1280; the aligner rounds each down to the 2048 grid, i.e. to 0,
    and no prefill ever advances. A slice is only usable if it can reach the aligner's grid, so the
    quantum must include block_size whenever the aligner demands aligned ends. Under the sub-block
    exception the aligner accepts sub-block ends and the recurrent block suffices. Without Mamba
    state there is no grid: any token count is usable.
    """
    if not is_aligned:
        return 1
    if sub_block_exception:
        return mamba_block_size
    return math.lcm(mamba_block_size, block_size)


def legacy_quantum_tokens(mamba_block_size: int) -> int:
    """The old rule, lcm over recurrent block sizes only. Kept for the regression test and the
    benchmark that show why it livelocks; never used by the planner."""
    return math.lcm(mamba_block_size)


def align_chunk(start: int, num_tokens: int, num_prompt_tokens: int, block_size: int, sub_block_exception: bool) -> int:
    """Returns how many of num_tokens a prefill chunk starting at `start` may keep (ALIGN mode).

    A non-final chunk must end on the block grid, so its end is rounded down to it. If that leaves
    nothing, the chunk gets 0 tokens, unless the sub-block exception holds: then it keeps all of them
    (no boundary lies inside it, so it re-aligns at the next one). The final chunk of the prompt
    (the tail after the last boundary) may have any length.
    """
    end = start + num_tokens
    if end >= num_prompt_tokens:
        return num_tokens
    aligned_end = end // block_size * block_size
    if aligned_end > start:
        return aligned_end - start
    return num_tokens if sub_block_exception else 0


def stop_at_last_boundary(start: int, num_tokens: int, num_prompt_tokens: int, block_size: int) -> int:
    """With prefix caching on, keeps a chunk from crossing the prompt's last block boundary.

    Mamba state exists only where a step ends. A chunk that runs from before the last boundary to
    the prompt's end would leave no state at that boundary, so the prompt's blocks could never be
    reused; ending the chunk there checkpoints them, and the short tail follows in the next step.
    """
    last_boundary = (num_prompt_tokens - 1) // block_size * block_size
    if start < last_boundary < start + num_tokens:
        return last_boundary - start
    return num_tokens


def smallest_useful_chunk(
    start: int, num_prompt_tokens: int, block_size: int, is_aligned: bool, sub_block_exception: bool
) -> int:
    """The fewest tokens a prefill at `start` can be granted and still advance: up to the next
    boundary (or the prompt end) while chunks must end on the grid, else one token."""
    if not is_aligned or sub_block_exception:
        return 1
    next_boundary = (start // block_size + 1) * block_size
    return min(num_prompt_tokens, next_boundary) - start


def progress_unit(quantum: int, sliced_only: bool, sub_block_exception: bool) -> int:
    """The least prefill budget with which a step must advance some prefill (guarantee 3): one
    quantum, except that plain chunked prefill under the sub-block exception advances with any
    budget. sliced_only: every pending prompt shares the step's mixed prefill budget
    (sliced_prompt_threshold), so each advances only in quanta."""
    return 1 if sub_block_exception and not sliced_only else quantum


def sliced_prompt_threshold(max_num_prefill_tokens_per_step: int, long_prompts_only: bool) -> int:
    """The prompt length above which a prompt shares a mixed step's prefill budget (micro-slicing's,
    the compute share's, or the smaller of the two), split in quanta. The budget bounds the step
    time the decodes wait on, and that time is every prefill token of the step, so by default the
    threshold is 0: every prompt shares it. With long_prompts_only
    (SchedulerConfig.micro_slice_long_prompts_only) it is the micro budget: a prompt that fits in it
    is planned as plain chunked prefill plans it (its one chunk is not what stalls a decode, a long
    prompt's big chunks are), and a step may then carry more prefill tokens than the budget."""
    return max_num_prefill_tokens_per_step if long_prompts_only else 0


def quanta_offer(available: int, quantum: int, tail_tokens: int) -> int:
    """What a sliced prefill is offered of `available` budget tokens: whole quanta, or its whole
    remaining prompt (`tail_tokens`) when that is more and fits. A chunk that finishes its prompt
    needs no grid, so budget below a quantum can still finish a short prompt: without this, a
    100-token prompt given a 2048-token quantum would leave 1948 tokens no other prefill could take,
    and a mixed step of short prompts would serve one prompt a quantum."""
    in_quanta = available // quantum * quantum
    return tail_tokens if in_quanta < tail_tokens <= available else in_quanta


def draft_limit(num_computed_tokens: int, num_output_tokens: int, max_tokens: int, grid: int) -> int:
    """The most draft tokens a decode may verify this step, before the budget and the pages.

    Generation limit: the decode itself samples one token and each accepted draft one more, so
    1 + drafts new outputs must fit in max_tokens. Block boundary (grid = block_size in ALIGN mode,
    else 0): Mamba state exists only where a step ends, and a plain decode [c, c + 1) never crosses a
    boundary, so a checkpoint is on every boundary the request passes. A checkpoint must be the state
    after accepted tokens, and whether a draft is accepted is known only after the step: the verified
    span [c, c + 1 + drafts) with drafts ends before the next boundary after c, (c // grid + 1) * grid
    (a decode whose own token reaches a boundary gets no drafts, and ends on it as it does today)."""
    limit = max_tokens - num_output_tokens - 1
    if grid > 0:
        limit = min(limit, (num_computed_tokens // grid + 1) * grid - num_computed_tokens - 2)
    return max(limit, 0)


def pages_for_tokens(num_tokens: int, kv_page_size: int) -> int:
    """KV pages that hold num_tokens tokens."""
    return -(-num_tokens // kv_page_size)


def new_pages_needed(num_computed_tokens: int, num_new_tokens: int, kv_page_size: int) -> int:
    """Pages a request must add to compute num_new_tokens more (it holds pages for its computed
    tokens; the last one may have room left)."""
    held = pages_for_tokens(num_computed_tokens, kv_page_size)
    return pages_for_tokens(num_computed_tokens + num_new_tokens, kv_page_size) - held


def max_tokens_for_pages(num_computed_tokens: int, num_free_pages: int, kv_page_size: int) -> int:
    """Most new tokens a request can compute with num_free_pages more pages."""
    held = pages_for_tokens(num_computed_tokens, kv_page_size)
    return (held + num_free_pages) * kv_page_size - num_computed_tokens


def split_quanta(num_quanta: int, num_prefills: int, step_index: int) -> list[int]:
    """Splits num_quanta among num_prefills prefills, in whole quanta.

    Quanta are dealt round-robin as one endless stream across steps: quantum j of step n goes to
    prefill (n * num_quanta + j) mod num_prefills. Every prefill gets floor(k/P) and the k mod P
    remainder quanta go to consecutive prefills from a start that advances by k every step, so with
    a stable set of P prefills each one is served within ceil(P/k) steps (fairness) and the split of
    one step depends on nothing but its inputs (determinism).
    """
    if num_prefills <= 0:
        return []
    base, remainder = divmod(num_quanta, num_prefills)
    shares = [base] * num_prefills
    start = (step_index * num_quanta) % num_prefills
    for offset in range(remainder):
        shares[(start + offset) % num_prefills] += 1
    return shares


def rotation_order(num_prefills: int, num_quanta: int, step_index: int) -> list[int]:
    """Prefill positions in the order the quantum stream reaches them this step (see split_quanta);
    the order in which capacity and leftover budget are offered."""
    if num_prefills <= 0:
        return []
    start = (step_index * num_quanta) % num_prefills
    return [(start + offset) % num_prefills for offset in range(num_prefills)]
