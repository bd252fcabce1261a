"""The CUDA backend: the model's primitive ops (paged attention, the Mamba2 mixer's conv and recurrence)
routed to the Triton kernels. Layers call it through their `ops` attribute when it is attached
(`gpu_worker.model.backends.attach_kernels`); otherwise they run the torch reference code.

Differences from the torch reference, all invisible in the results (up to float rounding):
- KV is written by a kernel that skips slot -1, and decode attention reads `seq_lens = position + 1`
  through the page table, so a padded row (position -1, state slot -1) of a CUDA-graph bucket reads
  and writes nothing. The decode mask and `decode_slot_start` of the context are not used.
- Prefill attention is one launch over every packed chunk, through a flat slot map of each chunk's
  context; the prefill conv is one launch over every chunk. The chunked SSD scan stays the torch
  matmul form (`ssd.ssd_scan`, float32), one call per chunk; states at block boundaries inside a
  chunk come from its per-chunk states (`boundary_states`), as in the reference path.
Per-forward metadata of the prefill chunks is built once per context and shared by every layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpu_worker.model.backends.cuda import attention as attn_k
from gpu_worker.model.backends.cuda import mamba as mamba_k
from gpu_worker.model.boundary_states import save_boundary_states
from gpu_worker.model.context import ForwardContext
from gpu_worker.model.ssd import ssd_scan

if TYPE_CHECKING:
    from gpu_worker.model.mamba2 import Mamba2Mixer


class PrefillMeta:
    """Device tensors describing the prefill chunks of one forward (packed rows after the decode group)."""

    def __init__(self, ctx: ForwardContext, device: torch.device) -> None:
        nd = ctx.num_decode
        attn_rows, conv_rows, offset = [], [], 0
        for span in ctx.prefills:
            attn_rows.append((span.token_start, span.num_tokens, span.start_pos, offset))
            conv_rows.append((span.token_start - nd, span.num_tokens, span.state_slot))
            offset += span.start_pos + span.num_tokens
        self.attn_spans = torch.tensor(attn_rows, dtype=torch.int64).to(device)  # [S, 4]
        self.conv_spans = torch.tensor(conv_rows, dtype=torch.int64).to(device)  # [S, 3], rows from nd
        self.slot_map = torch.cat([span.kv_slots for span in ctx.prefills]).to(device)  # [sum ctx lens]
        self.max_tokens = max(span.num_tokens for span in ctx.prefills)


class TritonOps:
    """Stateless apart from a one-entry memo of the current forward's prefill metadata."""

    name = "triton"

    def __init__(self) -> None:
        self._meta_ctx: ForwardContext | None = None
        self._meta: PrefillMeta | None = None

    def _prefill_meta(self, ctx: ForwardContext, device: torch.device) -> PrefillMeta:
        if self._meta_ctx is not ctx or self._meta is None:
            self._meta, self._meta_ctx = PrefillMeta(ctx, device), ctx
        return self._meta

    def paged_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] (RoPE applied) -> [T, heads, d]; writes k/v first."""
        attn_k.write_kv(k, v, k_cache, v_cache, ctx.kv_write_slots)
        out = torch.empty_like(q)
        nd = ctx.num_decode
        if nd:
            seq_lens = ctx.positions[:nd] + 1
            attn_k.paged_decode_attention(
                q[:nd], k_cache, v_cache, ctx.decode_page_table, seq_lens, ctx.kv_page_size_tokens, scale, out[:nd]
            )
        if ctx.prefills:
            meta = self._prefill_meta(ctx, q.device)
            attn_k.paged_prefill_attention(
                q, k_cache, v_cache, meta.attn_spans, meta.slot_map, meta.max_tokens, scale, out
            )
        return out

    def paged_rows_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        page_size: int,
        scale: float,
    ) -> torch.Tensor:
        """q [T, heads, d], each row a query over keys [0, seq_lens[t]) through page_table [T, W] (K/V already
        written) -> [T, heads, d]: the verify step's attention (decode_program.attention_verify), every
        position of a verify row a decode row of its own."""
        return attn_k.paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, page_size, scale)

    def mamba_mix(
        self,
        mixer: Mamba2Mixer,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        ctx: ForwardContext,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> torch.Tensor:
        """The mixer's middle: conv + SiLU, then the SSM. xbc [T, conv_dim], dt [T, H] float32 -> y
        [T, d_inner] float32 (before the gated norm), updating the pool rows of every sequence."""
        num_tokens, nd = xbc.shape[0], ctx.num_decode
        weight, bias = mixer.conv1d.weight[:, 0, :], mixer.conv1d.bias  # [conv_dim, K]
        y = torch.empty(num_tokens, mixer.num_heads, mixer.head_dim, dtype=torch.float32, device=xbc.device)
        if nd:
            slots = ctx.decode_state_slots
            x, B, C = mixer._split_xbc(mamba_k.conv_update(xbc[:nd], conv_state, weight, bias, slots))
            mamba_k.ssm_update(ssm_state, x, dt[:nd], A, B, C, mixer.D, None, slots, out=y[:nd])
        if ctx.prefills:
            meta = self._prefill_meta(ctx, xbc.device)
            conv_before = {
                i: conv_state[s.state_slot].clone() for i, s in enumerate(ctx.prefills) if ctx.boundaries_of(i)
            }
            x, B, C = mixer._split_xbc(mamba_k.conv_varlen(xbc[nd:], conv_state, weight, bias, meta.conv_spans))
            for i, span in enumerate(ctx.prefills):
                rows = slice(span.token_start - nd, span.token_start - nd + span.num_tokens)
                packed = slice(span.token_start, span.token_start + span.num_tokens)
                chunk_states: list[torch.Tensor] | None = [] if i in conv_before else None
                y_span, final = ssd_scan(
                    x[rows], dt[packed], A, B[rows], C[rows], mixer.D, ssm_state[span.state_slot], mixer.chunk_size,
                    chunk_states,
                )  # fmt: skip
                ssm_state[span.state_slot] = final
                y[packed] = y_span
                if chunk_states:
                    window = torch.cat([conv_before[i], xbc[packed].t()], dim=-1)  # [conv_dim, K-1+L]
                    inputs = (x[rows], dt[packed], A, B[rows], C[rows], mixer.D)
                    save_boundary_states(
                        ctx.boundaries_of(i), window, inputs, chunk_states[0], mixer.chunk_size, conv_state, ssm_state
                    )
        return y.view(num_tokens, mixer.d_inner)
