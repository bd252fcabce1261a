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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.model.context import ForwardContext

# Fewest context tokens a sequence needs to get its own SDPA call (the crossover above: one call
# costs ~25 us, the padded batched form grows with the batch's longest context).
LONG_CONTEXT_TOKENS = 384


@dataclass(frozen=True, slots=True)
class DecodeAttentionPlan:
    """The decode group split by context length; shared by every attention layer of one forward."""

    short_rows: torch.Tensor | None  # [s] int64 decode rows attended batched (None: every row is long)
    short_table: torch.Tensor | None  # [s, pages] the short rows' page tables, cut to their longest
    short_mask: torch.Tensor | None  # [s, 1, 1, pages * page size] bool, True at real positions
    long_rows: tuple[tuple[int, int, int | None], ...]  # (row, context tokens, first KV slot if pages are consecutive)


def plan_decode_attention(ctx: ForwardContext, min_long_tokens: int) -> DecodeAttentionPlan | None:
    """None when every decode sequence is short (the batched form over the whole group)."""
    key = (plan_decode_attention, min_long_tokens)
    if key in ctx.derived:
        return ctx.derived[key]  # type: ignore[return-value]
    nd, ps, table = ctx.num_decode, ctx.kv_page_size_tokens, ctx.decode_page_table
    lengths = ctx.positions[:nd] + 1  # context tokens, the new one included
    is_long = lengths >= min_long_tokens
    plan: DecodeAttentionPlan | None = None
    if bool(is_long.any()):
        num_pages = (lengths + ps - 1) // ps
        col = torch.arange(1, table.shape[1], device=table.device)
        steps_ok = (table[:, 1:] - table[:, :-1] == 1) | (col[None, :] >= num_pages[:, None])
        consecutive = steps_ok.all(dim=1)
        long_idx = is_long.nonzero()[:, 0]
        rows = long_idx.tolist()
        lens = lengths[long_idx].tolist()
        firsts = (table[long_idx, 0] * ps).tolist()
        runs = consecutive[long_idx].tolist()
        long_rows = tuple((r, n, f if ok else None) for r, n, f, ok in zip(rows, lens, firsts, runs, strict=True))
        short_idx = (~is_long).nonzero()[:, 0]
        short_rows = short_table = short_mask = None
        if short_idx.numel():
            width_pages = int(num_pages[short_idx].max())
            short_rows = short_idx
            short_table = table[short_idx, :width_pages]
            short_mask = ctx.decode_kv_mask[short_idx][..., : width_pages * ps]
        plan = DecodeAttentionPlan(short_rows, short_table, short_mask, long_rows)
    ctx.derived[key] = plan
    return plan


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
    v_cache: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """qg [b, kvh, g, d] -> [b, kvh, g, d]: the short rows batched, each long row on its own."""
    _, kvh, _, d = qg.shape
    ps = ctx.kv_page_size_tokens
    out = torch.empty_like(qg)
    if plan.short_rows is not None:
        assert plan.short_table is not None and plan.short_mask is not None
        short = batched_decode_attention(
            qg.index_select(0, plan.short_rows), plan.short_table, plan.short_mask, k_cache, v_cache, ps, scale
        )
        out.index_copy_(0, plan.short_rows, short)
    for row, length, first_slot in plan.long_rows:
        if first_slot is not None:  # consecutive pages: the cache rows themselves
            k, v = k_cache[first_slot : first_slot + length], v_cache[first_slot : first_slot + length]
        else:
            pages = ctx.decode_page_table[row, : (length + ps - 1) // ps]
            k = k_cache.view(-1, ps * kvh * d).index_select(0, pages).view(-1, kvh, d)[:length]
            v = v_cache.view(-1, ps * kvh * d).index_select(0, pages).view(-1, kvh, d)[:length]
        out[row] = F.scaled_dot_product_attention(qg[row], k.transpose(0, 1), v.transpose(0, 1), scale=scale)
    return out
