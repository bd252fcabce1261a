"""Decode attention over the paged KV cache: one query token per sequence.

Two forms, chosen per sequence by its context length (the plan is made once per forward, on the host,
and shared by every attention layer):

- short contexts, batched: every short sequence's pages gathered with `index_select` over page rows
  (advanced indexing `cache[table]` is ~5x slower on CPU), padded to the longest short context, then
  one SDPA call with a padding mask. Few small ops whatever the batch size.
- long contexts (at least `long_context_tokens`), one SDPA call per sequence straight on its cache
  rows when its pages are consecutive in the pool (a view: nothing copied), else on a gather of its
  own pages only. The batched form copies every sequence's pages padded to the longest context and
  then runs SDPA over the padding too: at 64 sequences of 1,000..3,000 tokens that is ~200 MB written
  and read again per layer per step, where the K/V actually read is ~140 MB.

Measured per layer, one thread (2 KV heads of 64, groups of 2, 16-token pages; sequences' pages in
order / scattered): 64 x 1,000..3,000 tokens 37.5 ms batched, 14.6 / 21.2 ms per sequence; 32 x 200..600
3.1 against 1.5 / 2.1 ms; 32 x 16..256 0.8 against 1.0 / 1.5 ms (short stays batched).

Many short contexts are batched in groups: once the padded gather of the short rows would pass
`group_bytes` (it then no longer stays in the core's caches between the copy and SDPA), they are sorted
by context length and attended DECODE_GROUP_ROWS at a time, each group padded to its own longest
(less padding too). Per layer, one thread, scattered pages, one batch / groups of 16 (ms): 48 x
16..256 (+32 decoded) 1.04 / 0.69, 64 x 16..256 1.85 / 1.10, 32 x 200..380 1.24 / 0.93, 64 x 200..380
3.64 / 2.34; under the budget one batch stays (64 x 16..64: 0.35 against 0.45 in groups; 32 x 16..256
0.49 / 0.47).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.model.backends.cpu.tiled_attention import page_key_values, tiled_attention
from gpu_worker.model.context import ForwardContext

# Fewest context tokens a sequence needs to get its own SDPA call (the crossover above: one call
# costs ~25 us, the padded batched form grows with the batch's longest context).
LONG_CONTEXT_TOKENS = 384
# Most bytes of K and V the short rows' padded gather may take before they go in groups (see above), and
# the rows per group.
DECODE_GROUP_BYTES = 8 << 20
DECODE_GROUP_ROWS = 16


@dataclass(frozen=True, slots=True)
class ShortGroup:
    """Short-context decode rows attended in one batched call."""

    rows: torch.Tensor  # [s] int64 decode rows
    table: torch.Tensor  # [s, pages] their page tables, cut to the group's longest
    mask: torch.Tensor  # [s, 1, 1, pages * page size] bool, True at real positions


@dataclass(frozen=True, slots=True)
class DecodeAttentionPlan:
    """The decode group split by context length; shared by every attention layer of one forward."""

    short_groups: tuple[ShortGroup, ...]  # the short rows, batched in one group or several (none: all long)
    long_rows: tuple[tuple[int, int, int | None], ...]  # (row, context tokens, first KV slot if pages are consecutive)


def plan_decode_attention(
    ctx: ForwardContext, min_long_tokens: int, max_padded_tokens: int = 1 << 62
) -> DecodeAttentionPlan | None:
    """None when every decode sequence is short and their padded gather holds at most
    `max_padded_tokens` tokens (the batched form over the whole group)."""
    key = (plan_decode_attention, min_long_tokens, max_padded_tokens)
    if key in ctx.derived:
        return ctx.derived[key]  # type: ignore[return-value]
    nd, ps = ctx.num_decode, ctx.kv_page_size_tokens
    lengths = ctx.positions[:nd] + 1  # context tokens, the new one included
    num_pages = (lengths + ps - 1) // ps
    is_long = lengths >= min_long_tokens
    any_long = bool(is_long.any())
    plan: DecodeAttentionPlan | None = None
    if any_long or nd * int(num_pages.max()) * ps > max_padded_tokens:
        long_rows = _long_rows(ctx, is_long.nonzero()[:, 0], lengths, num_pages) if any_long else ()
        short = _short_groups(ctx, (~is_long).nonzero()[:, 0], lengths, num_pages, max_padded_tokens)
        plan = DecodeAttentionPlan(short, long_rows)
    ctx.derived[key] = plan
    return plan


def _long_rows(
    ctx: ForwardContext, rows: torch.Tensor, lengths: torch.Tensor, num_pages: torch.Tensor
) -> tuple[tuple[int, int, int | None], ...]:
    """(row, context tokens, first KV slot when the row's pages are consecutive in the pool, else None)."""
    table, ps = ctx.decode_page_table[rows], ctx.kv_page_size_tokens
    col = torch.arange(1, table.shape[1], device=table.device)
    steps_ok = (table[:, 1:] - table[:, :-1] == 1) | (col[None, :] >= num_pages[rows][:, None])
    firsts = (table[:, 0] * ps).tolist()
    return tuple(
        (r, n, f if ok else None)
        for r, n, f, ok in zip(rows.tolist(), lengths[rows].tolist(), firsts, steps_ok.all(dim=1).tolist(), strict=True)
    )


def _short_groups(
    ctx: ForwardContext, rows: torch.Tensor, lengths: torch.Tensor, num_pages: torch.Tensor, max_padded_tokens: int
) -> tuple[ShortGroup, ...]:
    """The short rows in one group, or, past `max_padded_tokens` padded, shortest first in groups of
    DECODE_GROUP_ROWS (each group pads little); each group cut to its own longest."""
    if not rows.numel():
        return ()
    groups = [rows]
    if rows.numel() * int(num_pages[rows].max()) * ctx.kv_page_size_tokens > max_padded_tokens:
        by_length = rows[torch.argsort(lengths[rows], stable=True)]
        groups = [by_length[i : i + DECODE_GROUP_ROWS] for i in range(0, by_length.numel(), DECODE_GROUP_ROWS)]
    out = []
    for group in groups:
        width_pages = int(num_pages[group].max())
        mask = ctx.decode_kv_mask[group][..., : width_pages * ctx.kv_page_size_tokens]
        out.append(ShortGroup(group, ctx.decode_page_table[group, :width_pages], mask))
    return tuple(out)


def batched_decode_attention(
    qg: torch.Tensor, table: torch.Tensor, mask: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_size: int, scale: float,
) -> torch.Tensor:  # fmt: skip
    """qg [b, kvh, g, d], page tables [b, pages], mask [b, 1, 1, pages * page_size] -> [b, kvh, g, d]."""
    b, kvh, _, d = qg.shape
    width = table.shape[1] * page_size
    # index_select over page rows: one contiguous copy per page
    pages = table.reshape(-1)
    k = k_cache.view(-1, page_size * kvh * d).index_select(0, pages).view(b, width, kvh, d).transpose(1, 2)
    v = v_cache.view(-1, page_size * kvh * d).index_select(0, pages).view(b, width, kvh, d).transpose(1, 2)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)


def split_decode_attention(
    qg: torch.Tensor, plan: DecodeAttentionPlan, ctx: ForwardContext, k_cache: torch.Tensor,
    v_cache: torch.Tensor, scale: float, key_tile: int = 1 << 62,
) -> torch.Tensor:  # fmt: skip
    """qg [b, kvh, g, d] -> [b, kvh, g, d]: the short rows batched by group, each long row on its own; a row
    of more than `key_tile` context tokens in key tiles (gpu_worker.model.backends.cpu.tiled_attention)."""
    _, kvh, _, d = qg.shape
    ps = ctx.kv_page_size_tokens
    out = torch.empty_like(qg)
    for group in plan.short_groups:
        short = batched_decode_attention(
            qg.index_select(0, group.rows), group.table, group.mask, k_cache, v_cache, ps, scale
        )
        out.index_copy_(0, group.rows, short)
    for row, length, first_slot in plan.long_rows:
        if length > key_tile:
            pages = ctx.decode_page_table[row]
            keys = page_key_values(k_cache, v_cache, pages, ps, first_slot)
            q_row = qg[row].reshape(1, -1, d)  # [1, heads, d] at position length - 1
            out[row] = tiled_attention(q_row, keys, length - 1, scale, key_tile).view(kvh, -1, d)
            continue
        if first_slot is not None:  # consecutive pages: the cache rows themselves
            k, v = k_cache[first_slot : first_slot + length], v_cache[first_slot : first_slot + length]
        else:
            pages = ctx.decode_page_table[row, : (length + ps - 1) // ps]
            k = k_cache.view(-1, ps * kvh * d).index_select(0, pages).view(-1, kvh, d)[:length]
            v = v_cache.view(-1, ps * kvh * d).index_select(0, pages).view(-1, kvh, d)[:length]
        # 4-D (a batch of one): CPU SDPA runs its flash kernel on 4-D inputs and the plain math on 3-D
        # ones, 2.5-4x slower here (one row, 2 KV heads of 64 in groups of 2, one thread, us per call:
        # 1,000 keys 157 -> 38, 3,000 keys 918 -> 271, 6,000 keys 2,172 -> 759).
        k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        out[row] = F.scaled_dot_product_attention(qg[row : row + 1], k4, v4, scale=scale)[0]
    return out
