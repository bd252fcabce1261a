"""Causal GQA attention over a paged KV cache.

Each layer owns a K and a V tensor of flat token slots [num_pages * kv_page_size, kv_heads, head_dim].
A forward first writes the chunk's K/V into its slots, then attends over the whole context [0, start+len)
gathered through the page table. Query heads are grouped by their KV head ([kv_heads, group * L, d]) so
K/V are never repeated.

Step memory: what a prefill chunk's attention holds grows with its context (the gathered K/V, the scores
of a query block over every key). `workspace_bytes` bounds it (gpu_worker.runner.profile sets it from the
activation budget at start-up): a chunk whose untiled attention would hold more runs in key tiles merged
by log-sum-exp (gpu_worker.model.backends.cpu.tiled_attention), and so does a decode row whose context
is longer than one tile; the math path's [group * L, context] mask and scores go by query tiles instead."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model.backends.cpu.chunk_attention import can_use_flash, chunk_attention
from gpu_worker.model.backends.cpu.decode_attention import (
    DECODE_GROUP_BYTES,
    LONG_CONTEXT_TOKENS,
    batched_decode_attention,
    plan_decode_attention,
    split_decode_attention,
)
from gpu_worker.model.backends.cpu.tiled_attention import (
    key_tile_tokens,
    slot_key_values,
    tiled_attention,
    untiled_bytes,
)
from gpu_worker.model.config import BambaConfig
from gpu_worker.model.context import ForwardContext, PrefillSpan
from gpu_worker.model.layers import apply_rope

if TYPE_CHECKING:
    from gpu_worker.model.backends.cuda.ops import TritonOps


DEFAULT_WORKSPACE_BYTES = 256 << 20  # a model used outside a runner (tests, tools)


class PagedAttention(nn.Module):
    """q/k/v/o projections, RoPE on the first rotary_dim dims (none when the family has no positional
    embedding), softmax scale `attention_scale`."""

    ops: TritonOps | None = None  # the CUDA backend's kernels when attached (gpu_worker.model.backends)
    # decode sequences with at least this many context tokens attend one by one, on their own pages
    decode_long_context_tokens = LONG_CONTEXT_TOKENS
    decode_group_bytes = DECODE_GROUP_BYTES  # short rows' padded K/V gather above this: attended in groups
    # the most bytes one call's context-scaled temporaries may hold (K/V gathers, scores); the runner sets
    # it from the activation budget (gpu_worker.runner.profile.bound_step_memory)
    workspace_bytes = DEFAULT_WORKSPACE_BYTES

    def __init__(self, config: BambaConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.group = self.num_heads // self.num_kv_heads
        self.scale = c.attention_scale
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; writes this batch's K/V into k_cache/v_cache. cos/sin are
        None for a model without RoPE."""
        n = hidden.shape[0]
        q = self.q_proj(hidden).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(n, self.num_kv_heads, self.head_dim)
        if cos is not None and sin is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(hidden).view(n, self.num_kv_heads, self.head_dim)
        if self.ops is not None:
            attended = self.ops.paged_attention(q, k, v, ctx, k_cache, v_cache, self.scale)
            return self.o_proj(attended.view(n, self.num_heads * self.head_dim))  # type: ignore[no-any-return]
        k_cache.index_copy_(0, ctx.kv_write_slots, k)
        v_cache.index_copy_(0, ctx.kv_write_slots, v)
        outs: list[torch.Tensor] = []
        if ctx.num_decode:
            outs.append(self._decode(q[: ctx.num_decode], ctx, k_cache, v_cache))
        for span in ctx.prefills:
            outs.append(self._prefill(q[span.token_start : span.token_start + span.num_tokens], span, k_cache, v_cache))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        projected: torch.Tensor = self.o_proj(out)
        return projected

    def _decode(
        self, q: torch.Tensor, ctx: ForwardContext, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """q [b, heads, d] -> [b, heads * d]; short contexts batched over their pages padded to the
        longest (in groups when many), long ones one by one on their own pages
        (gpu_worker.model.backends.cpu.decode_attention)."""
        b = q.shape[0]
        qg = q.view(b, self.num_kv_heads, self.group, self.head_dim)  # [b, kvh, g, d]
        token_bytes = 2 * k_cache[0].numel() * k_cache.element_size()  # K and V of one context token
        plan = plan_decode_attention(ctx, self.decode_long_context_tokens, self.decode_group_bytes // token_bytes)
        if plan is None:
            table, mask, ps = ctx.decode_page_table, ctx.decode_kv_mask, ctx.kv_page_size_tokens
            out = batched_decode_attention(qg, table, mask, k_cache, v_cache, ps, self.scale)  # [b, kvh, g, d]
        else:
            tile = self._key_tile(1, k_cache)
            out = split_decode_attention(qg, plan, ctx, k_cache, v_cache, self.scale, tile)
        return out.reshape(b, self.num_heads * self.head_dim)

    def _prefill(
        self, q: torch.Tensor, span: PrefillSpan, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """q [L, heads, d] -> [L, heads * d]; causal over [0, start_pos + L)."""
        L, start = span.num_tokens, span.start_pos
        if can_use_flash(q):
            es = k_cache.element_size()
            if untiled_bytes(L, start + L, self.num_heads, self.num_kv_heads, self.head_dim, es) > self.workspace_bytes:
                keys = slot_key_values(k_cache, v_cache, span.kv_slots)
                out = tiled_attention(q, keys, start, self.scale, self._key_tile(L, k_cache))
                return out.reshape(L, self.num_heads * self.head_dim)
            k_ctx, v_ctx = k_cache[span.kv_slots], v_cache[span.kv_slots]  # [ctx, kvh, d]
            return chunk_attention(q, k_ctx, v_ctx, start, self.scale).reshape(L, self.num_heads * self.head_dim)
        k = k_cache[span.kv_slots].transpose(0, 1)  # [kvh, ctx, d]
        v = v_cache[span.kv_slots].transpose(0, 1)
        rows = self._query_tile(L, start + L)
        outs = [self._prefill_math(q[r : r + rows], start + r, k, v) for r in range(0, L, rows)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _prefill_math(self, q: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [L, heads, d] at positions [start, start + L) over k/v [kvh, >= start + L, d] -> [L, heads * d]:
        SDPA with a dense mask (the path off CPU's flash kernel; L is a query tile)."""
        L = q.shape[0]
        k, v = k[:, : start + L], v[:, : start + L]
        qg = q.view(L, self.num_kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3)  # [kvh, g, L, d]
        qg = qg.reshape(self.num_kv_heads, self.group * L, self.head_dim)
        if start == 0 and self.group == 1:
            out = F.scaled_dot_product_attention(qg, k, v, is_causal=True, scale=self.scale)
        else:
            key_pos = torch.arange(start + L, device=q.device)
            query_pos = torch.arange(start, start + L, device=q.device)
            mask = (key_pos[None, :] <= query_pos[:, None]).repeat(self.group, 1)  # [g * L, ctx]
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
        out = out.view(self.num_kv_heads, self.group, L, self.head_dim).permute(2, 0, 1, 3)
        return out.reshape(L, self.num_heads * self.head_dim)

    def _key_tile(self, num_queries: int, k_cache: torch.Tensor) -> int:
        """Keys per tile of a tiled call of `num_queries` queries within `workspace_bytes`."""
        es = k_cache.element_size()
        return key_tile_tokens(self.workspace_bytes, num_queries, self.num_heads, self.num_kv_heads, self.head_dim, es)

    def _query_tile(self, num_queries: int, num_keys: int) -> int:
        """Queries per call of the math path: its mask (bool) and scores and probabilities (float32) of
        [heads, rows, keys] within `workspace_bytes` (at least one row)."""
        per_row = self.num_heads * num_keys * (1 + 2 * 4)
        return max(1, min(num_queries, self.workspace_bytes // per_row))
