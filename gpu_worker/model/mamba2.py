"""The Mamba2 mixer over a packed batch, reading and writing a state pool.

State per sequence (one pool row): conv state = the last d_conv - 1 pre-conv xBC inputs [conv_dim, K-1]
(model dtype), SSM state [H, P, N] (float32). A sequence whose start position is 0 must have a zeroed row
(the runner zeroes it); any other chunk continues exactly from whatever the row holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model.backends.cpu import mamba_prefill
from gpu_worker.model.backends.cpu.packed_prefill import packed_causal_conv, packed_index_for
from gpu_worker.model.backends.cpu.packed_scan import packed_scan
from gpu_worker.model.backends.cpu.short_scan import RECORDS_KEY, SHORT_SPAN_TOKENS, ShortSpanRecord, short_spans_scan
from gpu_worker.model.boundary_states import save_boundary_states
from gpu_worker.model.config import BambaConfig
from gpu_worker.model.context import BoundaryState, ForwardContext, PrefillSpan
from gpu_worker.model.layers import GatedRMSNorm
from gpu_worker.model.ssd import ssd_scan, ssm_step_

if TYPE_CHECKING:
    from gpu_worker.model.backends.cuda.ops import TritonOps

# (mixer, zxbcdt of the decode group [nd, width], ctx, conv pool, ssm pool) -> gated-normed y [nd, d_inner]
FusedDecode = Callable[["Mamba2Mixer", torch.Tensor, ForwardContext, torch.Tensor, torch.Tensor], torch.Tensor]


class Mamba2Mixer(nn.Module):
    """in_proj -> [z, xBC, dt]; causal depthwise conv + SiLU on xBC; SSD; gated RMS norm; out_proj."""

    ops: TritonOps | None = None  # the CUDA backend's kernels when attached (gpu_worker.model.backends)
    # the compiled decode step when attached (gpu_worker.model.backends.cpu.compiled_decode): decode group -> normed y
    fused_decode: FusedDecode | None = None
    packed_prefill = True  # every prefill chunk in one conv + one scan; False: one scan per chunk (the oracle)
    # the packed conv and scan in C (backends/cpu/mamba_prefill: the scan as the plain recurrence instead of
    # chunked GEMMs): set on CPU by the runner where the kernels build
    native_prefill = False

    def __init__(self, config: BambaConfig) -> None:
        super().__init__()
        c = config
        self.d_inner, self.conv_dim = c.d_inner, c.conv_dim
        self.num_heads, self.head_dim = c.mamba_n_heads, c.mamba_d_head
        self.num_groups, self.state_size = c.mamba_n_groups, c.mamba_d_state
        self.chunk_size = c.mamba_chunk_size
        self.dt_min, self.dt_max = c.time_step_min, c.time_step_max
        self.in_proj = nn.Linear(c.hidden_size, c.d_inner + c.conv_dim + c.mamba_n_heads, bias=c.mamba_proj_bias)
        self.conv1d = nn.Conv1d(
            c.conv_dim, c.conv_dim, c.mamba_d_conv, groups=c.conv_dim, bias=c.mamba_conv_bias
        )  # holds weight [conv_dim, 1, K] and bias; applied functionally below
        self.dt_bias = nn.Parameter(torch.zeros(c.mamba_n_heads))
        self.A_log = nn.Parameter(torch.zeros(c.mamba_n_heads))
        self.D = nn.Parameter(torch.ones(c.mamba_n_heads))
        self.norm = GatedRMSNorm(c.d_inner, c.mamba_n_groups, c.rms_norm_eps)
        self.out_proj = nn.Linear(c.d_inner, c.hidden_size, bias=c.mamba_proj_bias)

    def forward(
        self, hidden: torch.Tensor, ctx: ForwardContext, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]. conv_state [rows, conv_dim, K-1] and ssm_state
        [rows, H, P, N] are this layer's pool tensors; the rows of the batch's sequences are updated."""
        zxbcdt = self.in_proj(hidden)  # [T, d_inner + conv_dim + H]
        if self.fused_decode is not None and ctx.num_decode and self.ops is None:
            fused = self._forward_fused(self.fused_decode, zxbcdt, ctx, conv_state, ssm_state)
            return self.out_proj(fused)  # type: ignore[no-any-return]
        z, xbc, dt = zxbcdt.split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        dt = torch.clamp(F.softplus(dt.float() + self.dt_bias.float()), self.dt_min, self.dt_max)  # [T, H]
        A = -torch.exp(self.A_log.float())  # [H]
        if self.ops is not None:
            y = self.ops.mamba_mix(self, xbc, dt, A, ctx, conv_state, ssm_state)
        else:
            ys: list[torch.Tensor] = []
            nd = ctx.num_decode
            if nd:
                ys.append(self._decode(xbc[:nd], dt[:nd], A, ctx, conv_state, ssm_state))
            ys += self._prefill_rows(xbc, dt, A, ctx, conv_state, ssm_state)
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=0)  # [T, d_inner] float32
        out: torch.Tensor = self.out_proj(self.norm(y, z).to(hidden.dtype))
        return out

    def _forward_fused(
        self,
        fused: FusedDecode,
        zxbcdt: torch.Tensor,
        ctx: ForwardContext,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> torch.Tensor:
        """The decode group through the compiled step, the prefill rows (if any) through the eager
        code; both gated-normed ([T, d_inner], out_proj input)."""
        nd = ctx.num_decode
        normed = fused(self, zxbcdt[:nd], ctx, conv_state, ssm_state)  # [nd, d_inner]
        if not ctx.prefills:
            return normed
        z, xbc, dt = torch.split(zxbcdt, [self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        dt = torch.clamp(F.softplus(dt.float() + self.dt_bias.float()), self.dt_min, self.dt_max)
        A = -torch.exp(self.A_log.float())
        y = torch.cat(self._prefill_rows(xbc, dt, A, ctx, conv_state, ssm_state))
        return torch.cat([normed, self.norm(y, z[nd:]).to(zxbcdt.dtype)])

    def _prefill_rows(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        ctx: ForwardContext,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> list[torch.Tensor]:
        """The prefill chunks' SSD outputs, in order: one packed scan, or one scan per chunk."""
        if not ctx.prefills:
            return []
        if self.packed_prefill:
            return [self._prefill_packed(xbc, dt, A, ctx, conv_state, ssm_state)]
        return [
            self._prefill(
                xbc[span.token_start : span.token_start + span.num_tokens],
                dt[span.token_start : span.token_start + span.num_tokens],
                A,
                span,
                conv_state,
                ssm_state,
                ctx.boundaries_of(i),
            )  # fmt: skip
            for i, span in enumerate(ctx.prefills)
        ]

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gn = self.num_groups * self.state_size
        x, B, C = xbc[:, : self.d_inner], xbc[:, self.d_inner : self.d_inner + gn], xbc[:, self.d_inner + gn :]
        n = x.shape[0]
        return (
            x.reshape(n, self.num_heads, self.head_dim),
            B.reshape(n, self.num_groups, self.state_size),
            C.reshape(n, self.num_groups, self.state_size),
        )

    def _decode(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        ctx: ForwardContext,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> torch.Tensor:
        """All single-token sequences at once. xbc [b, conv_dim], dt [b, H] -> y [b, d_inner].

        When the decode group's slots are one contiguous run the pool rows are updated in place through
        a slice; otherwise they are gathered, updated and scattered back."""
        b = xbc.shape[0]
        first = ctx.decode_slot_start
        rows = ctx.decode_state_slots
        conv_rows = conv_state[first : first + b] if first is not None else conv_state.index_select(0, rows)
        window = torch.cat([conv_rows, xbc[:, :, None]], dim=-1)  # [b, conv_dim, K]
        if first is not None:
            conv_rows.copy_(window[:, :, 1:])
        else:
            conv_state.index_copy_(0, rows, window[:, :, 1:])
        conv = (window * self.conv1d.weight[:, 0, :]).sum(dim=-1)  # [b, conv_dim]
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        x, B, C = self._split_xbc(F.silu(conv))
        if first is not None:
            y = ssm_step_(ssm_state[first : first + b], x, dt, A, B, C, self.D)
        else:
            state = ssm_state.index_select(0, rows)
            y = ssm_step_(state, x, dt, A, B, C, self.D)
            ssm_state.index_copy_(0, rows, state)
        return y.reshape(b, self.d_inner)

    def _prefill(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        span: PrefillSpan,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        boundaries: tuple[BoundaryState, ...] = (),
    ) -> torch.Tensor:
        """One multi-token chunk continuing from its state row. xbc [L, conv_dim] -> y [L, d_inner].
        The states at `boundaries` inside the chunk go to their checkpoint rows."""
        row = span.state_slot
        keep = conv_state.shape[-1]  # K - 1
        window = torch.cat([conv_state[row], xbc.t()], dim=-1)  # [conv_dim, K-1+L]
        conv_state[row] = window[:, window.shape[-1] - keep :]
        conv = F.conv1d(window[None], self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)[0]
        x, B, C = self._split_xbc(F.silu(conv.t()))  # conv: [conv_dim, L]
        chunk_states: list[torch.Tensor] | None = [] if boundaries else None
        y, final_state = ssd_scan(x, dt, A, B, C, self.D, ssm_state[row], self.chunk_size, chunk_states)
        ssm_state[row] = final_state
        if chunk_states:
            inputs = (x, dt, A, B, C, self.D)
            save_boundary_states(boundaries, window, inputs, chunk_states[0], self.chunk_size, conv_state, ssm_state)
        return y.reshape(y.shape[0], self.d_inner)

    def _prefill_packed(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        ctx: ForwardContext,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> torch.Tensor:
        """Every multi-token chunk of the batch at once (gpu_worker.model.backends.cpu.packed_prefill).
        xbc [T, conv_dim] of the whole batch -> y [Tp, d_inner] of its prefill rows."""
        index = packed_index_for(ctx, self.chunk_size, conv_state.shape[-1], xbc.device)
        first = ctx.prefills[0].token_start  # the spans are contiguous after the decode group
        rows = slice(first, first + index.num_prefill_tokens)
        wanted = [(i, ctx.boundaries_of(i)) for i in range(index.num_seqs)] if ctx.boundary_states else []
        wanted = [(i, points) for i, points in wanted if points]
        short = max(span.num_tokens for span in ctx.prefills) <= SHORT_SPAN_TOKENS
        before = range(index.num_seqs) if short else [i for i, _ in wanted]  # short spans keep every window
        conv_before = {i: conv_state[ctx.prefills[i].state_slot].clone() for i in before}  # the conv updates it
        lengths = [span.num_tokens for span in ctx.prefills]
        native = self.native_prefill and xbc.device.type == "cpu"
        if native and conv_state.dtype == torch.float32:  # a bfloat16 model's conv runs in bfloat16, in torch
            conv = mamba_prefill.causal_conv(xbc[rows], self.conv1d.weight, self.conv1d.bias, conv_state,
                                             index.state_slots, lengths)  # fmt: skip
        else:
            conv = packed_causal_conv(xbc[rows], self.conv1d.weight, self.conv1d.bias, conv_state, index)
        x, B, C = self._split_xbc(F.silu(conv))
        initial = ssm_state.index_select(0, index.state_slots)
        if short:  # verify rows and short chunks (short_scan)
            records = ctx.derived.get(RECORDS_KEY)
            y, final, spans = short_spans_scan(x, dt[rows], A, B, C, self.D, initial, lengths)
            ssm_state.index_copy_(0, index.state_slots, final.to(ssm_state.dtype))
            windows = [torch.cat([conv_before[i], xbc[rows][s.token_start - first : s.token_start - first
                                  + s.num_tokens].t()], dim=-1) for i, s in enumerate(ctx.prefills)]  # fmt: skip
            keep = conv_state.shape[-1]
            for i, points in wanted:
                for point in points:
                    conv_state[point.row] = windows[i][:, point.offset : point.offset + keep]
                    ssm_state[point.row] = spans.state_at(i, point.offset - 1).to(ssm_state.dtype)
            if isinstance(records, list):  # the forward keeps them for speculation's rollback
                slots = tuple(s.state_slot for s in ctx.prefills)
                records.append(ShortSpanRecord(conv_state, ssm_state, slots, spans, tuple(windows)))
            return y.reshape(index.num_prefill_tokens, self.d_inner)
        if native:
            scan = mamba_prefill.sequential_scan(x, dt[rows], A, B, C, self.D, initial, lengths, self.chunk_size,
                                                chunk_states=bool(wanted))  # fmt: skip
        else:
            scan = packed_scan(x, dt[rows], A, B, C, self.D, initial, index)
        ssm_state.index_copy_(0, index.state_slots, scan.final_states.to(ssm_state.dtype))
        for i, points in wanted:  # states at block boundaries inside span i, from the scan's chunk states
            t0 = ctx.prefills[i].token_start - first
            span_rows = slice(t0, t0 + ctx.prefills[i].num_tokens)
            window = torch.cat([conv_before[i], xbc[rows][span_rows].t()], dim=-1)
            start, count = index.chunk_start[i], index.chunk_count[i]
            states = torch.cat([scan.chunk_start_states[start : start + count], scan.final_states[i : i + 1]])
            inputs = (x[span_rows], dt[rows][span_rows], A, B[span_rows], C[span_rows], self.D)
            save_boundary_states(points, window, inputs, states, self.chunk_size, conv_state, ssm_state)
        return scan.y.reshape(index.num_prefill_tokens, self.d_inner)
