"""Decode attention split by context length (gpu_worker.model.backends.cpu.decode_attention): logits vs transformers at
the parity tolerance with short and long contexts in one decode group, long ones on consecutive pages
(cache views) and on scattered pages (gathered); the plan's split; many short rows in groups by length
past the gather budget; the split form against the batched padded form on random caches."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.model.attention import PagedAttention
from gpu_worker.model.backends.cpu import decode_attention
from gpu_worker.model.backends.cpu.decode_attention import (
    DECODE_GROUP_ROWS,
    batched_decode_attention,
    plan_decode_attention,
    split_decode_attention,
)
from gpu_worker.model.context import ForwardContext
from gpu_worker.runner.batch import Batch
from tests.model.model_helpers import Request, hf_logits, make_runner

TOL = 1e-4  # the parity tests' tolerance
LONG = 16  # context tokens from which a test sequence attends on its own


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode_ctx(positions: list[int], table: list[list[int]], page_size: int) -> ForwardContext:
    pos = torch.tensor(positions)
    width = len(table[0]) * page_size
    return ForwardContext(
        positions=pos, kv_write_slots=pos, num_decode=len(positions), decode_state_slots=torch.arange(len(positions)),
        decode_slot_start=0, kv_page_size_tokens=page_size, decode_page_table=torch.tensor(table),
        decode_kv_mask=(torch.arange(width)[None, :] <= pos[:, None]).view(len(positions), 1, 1, width), prefills=(),
    )  # fmt: skip


@pytest.mark.parametrize("grouped", [False, True])
def test_long_and_short_contexts_match_reference(family_checkpoint, grouped: bool, monkeypatch) -> None:
    """grouped: every short row in a group of its own (a zero gather budget, groups of one row)."""
    hf, path = family_checkpoint
    vocab = hf.config.vocab_size
    runner = make_runner(path, page_size=4)
    if grouped:
        monkeypatch.setattr(decode_attention, "DECODE_GROUP_ROWS", 1)
    for module in runner.model.modules():
        if isinstance(module, PagedAttention):
            module.decode_long_context_tokens = LONG
            module.decode_group_bytes = 0 if grouped else module.decode_group_bytes
    lengths = (30, 5, 22, 8, 26)  # 30 and 26 interleave their pages (scattered); 22 is consecutive
    full = [_prompt(vocab, n + 6, seed=i) for i, n in enumerate(lengths)]
    refs = [hf_logits(hf, ids) for ids in full]
    reqs = [Request(runner, ids) for ids in full]
    reqs[2].page_ids = runner.kv_pool.allocate(8)  # consecutive pages for all its 28 tokens
    runner.forward(Batch((reqs[2].chunk(22), reqs[1].chunk(5), reqs[3].chunk(8))))
    for n4 in (9, 9, 8):  # requests 0 and 4 allocate pages in turn: neither has consecutive pages
        runner.forward(Batch((reqs[0].chunk(10), reqs[4].chunk(n4))))
    assert [r.num_computed for r in reqs] == list(lengths)
    for _ in range(6):
        batch = Batch(tuple(r.chunk(1) for r in reqs))
        out = runner.forward(batch)
        for i, seq in enumerate(batch.sequences):
            diff = (out.logits[i] - refs[i][seq.start_pos]).abs().max().item()
            assert diff <= TOL, f"request {i} at position {seq.start_pos}: max abs diff {diff}"
    # the last step's plan had both forms and both kinds of long rows
    packed_ctx = _decode_ctx(
        [r.num_computed - 1 for r in sorted(reqs, key=lambda r: r.slot)],
        [r.page_ids[:9] + [0] * (9 - len(r.page_ids[:9])) for r in sorted(reqs, key=lambda r: r.slot)], 4,
    )  # fmt: skip
    plan = plan_decode_attention(packed_ctx, LONG)
    assert plan is not None and len(plan.short_groups) == 1 and plan.short_groups[0].rows.numel() == 2
    assert sorted(first is None for _, _, first in plan.long_rows) == [False, True, True]


def test_plan_splits_by_context_length() -> None:
    ctx = _decode_ctx(
        [3, 20, 9, 15], [[1, 0, 0, 0, 0, 0], [2, 3, 4, 5, 6, 7], [8, 9, 10, 0, 0, 0], [11, 13, 12, 14, 0, 0]], 4
    )
    assert plan_decode_attention(ctx, 32) is None  # every context short: one batched call
    plan = plan_decode_attention(ctx, 11)
    assert plan is not None and plan is plan_decode_attention(ctx, 11)  # made once per forward
    assert plan.long_rows == ((1, 21, 8), (3, 16, None))  # row, tokens, first slot when consecutive
    (short,) = plan.short_groups
    assert short.rows.tolist() == [0, 2]
    assert short.table.tolist() == [[1, 0, 0], [8, 9, 10]]
    assert short.mask.shape == (2, 1, 1, 12)
    assert plan_decode_attention(ctx, 32, max_padded_tokens=4 * 6 * 4) is None  # the whole group's gather fits


def test_many_short_rows_go_in_groups_by_length() -> None:
    """Past the padded-gather budget the short rows are sorted by context length and attended
    DECODE_GROUP_ROWS at a time, each group cut to its own longest; the result is the padded form's, and
    a key read by one row moves that row only."""
    gen = torch.Generator().manual_seed(1)
    page, kvh, group, d = 4, 2, 2, 8
    rows = DECODE_GROUP_ROWS * 2 + 5
    positions = torch.randint(0, 40, (rows,), generator=gen).tolist()
    width = max(positions) // page + 1
    slots = torch.randperm(rows * width, generator=gen).view(rows, width).tolist()  # scattered pages
    ctx = _decode_ctx(positions, slots, page)
    k_cache, v_cache = (torch.randn(rows * width * page, kvh, d, generator=gen) for _ in range(2))
    assert plan_decode_attention(ctx, 1 << 30) is None  # no budget given: one batched call
    plan = plan_decode_attention(ctx, 1 << 30, max_padded_tokens=rows * width * page - 1)
    assert plan is not None and not plan.long_rows
    assert [g.rows.numel() for g in plan.short_groups] == [DECODE_GROUP_ROWS, DECODE_GROUP_ROWS, 5]
    ordered = [positions[r] for g in plan.short_groups for r in g.rows.tolist()]
    assert ordered == sorted(positions) and sorted(r for g in plan.short_groups for r in g.rows.tolist()) == list(
        range(rows)
    )
    for g in plan.short_groups:  # each padded to its own longest
        longest = max(positions[r] for r in g.rows.tolist()) + 1
        assert g.table.shape[1] == -(-longest // page) and g.mask.shape[-1] == g.table.shape[1] * page
    qg = torch.randn(rows, kvh, group, d, generator=gen)
    padded = batched_decode_attention(qg, ctx.decode_page_table, ctx.decode_kv_mask, k_cache, v_cache, page, 0.3)
    grouped = split_decode_attention(qg, plan, ctx, k_cache, v_cache, 0.3)
    torch.testing.assert_close(grouped, padded, rtol=1e-5, atol=1e-5)
    target = 7
    k_cache[slots[target][0] * page] += 1.0  # its first key
    changed = (split_decode_attention(qg, plan, ctx, k_cache, v_cache, 0.3) - grouped).abs().amax(dim=(1, 2, 3))
    assert changed.nonzero()[:, 0].tolist() == [target]


def test_split_form_equals_padded_form() -> None:
    gen = torch.Generator().manual_seed(0)
    page, kvh, group, d = 4, 2, 3, 8
    k_cache, v_cache = (torch.randn(40 * page, kvh, d, generator=gen) for _ in range(2))
    positions = [2, 17, 30, 9, 25]
    table = [[5, 0, 0, 0, 0, 0, 0, 0], [10, 11, 12, 13, 14, 0, 0, 0], [20, 1, 22, 2, 24, 3, 26, 27],
             [30, 31, 32, 0, 0, 0, 0, 0], [33, 34, 35, 36, 37, 38, 39, 0]]  # fmt: skip
    ctx = _decode_ctx(positions, table, page)
    qg = torch.randn(len(positions), kvh, group, d, generator=gen)
    padded = batched_decode_attention(qg, ctx.decode_page_table, ctx.decode_kv_mask, k_cache, v_cache, page, 0.3)
    plan = plan_decode_attention(ctx, 11)
    assert plan is not None and len(plan.long_rows) == 3
    split = split_decode_attention(qg, plan, ctx, k_cache, v_cache, 0.3)
    assert (split - padded).abs().max().item() < 1e-5
    v_cache[24 * page] += 1.0  # a key the 31-token context reads: only its row changes
    changed = (split_decode_attention(qg, plan, ctx, k_cache, v_cache, 0.3) - split).abs().amax(dim=(1, 2, 3))
    assert changed.nonzero()[:, 0].tolist() == [2]
