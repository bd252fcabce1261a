"""The packed SSD scan in factored form: every matmul one batched GEMM over all heads of a group.

`packed_prefill.packed_ssd_scan` builds, per head and scan chunk, the [Q x Q] decay matrix
exp(a_cum[l] - a_cum[s]) from segment sums and multiplies it into C.B before a per-head [Q x Q] @ [Q x P]
product: H x (elementwise passes + small GEMMs + einsum permutes). The decay factors, though:

    exp(a_cum[l] - a_cum[s]) = exp(a_cum[l] - r) * exp(r - a_cum[s])        (any reference r per chunk, head)

so the within-chunk output is y[l] = w_out[l] * sum_{s<=l} (C_l . B_s) (w_in[s] * dt_s * x_s) with
w_out = exp(a_cum - r), w_in = exp(r - a_cum): the masked C.B matrix is shared by every head of a group,
and one [Q x Q] @ [Q x (heads x P)] GEMM per chunk does all heads. The chunk's own end state is
(w_in * dt * x)^T B times exp(a_last - r), and the contribution of the chunk's start state is
w_out[l] * exp(r) * C_l . S_start. Layouts stay [chunk, token, head, channel] throughout, so no
operand is permuted.

r = a_last / 2 (half the chunk's total log-decay, a_cum being non-increasing) keeps every factor in
[exp(a_last / 2), exp(-a_last / 2)]. The products are then as exact as the segment-sum form (each term
is scaled by positive factors, no differences of large numbers), provided the factors stay normal
float32 numbers: when a chunk decays by more than `MAX_CHUNK_LOG_DECAY` (e^-120, in practice only with
dt * |A| far beyond trained values) the scan takes the segment-sum form instead.

Measured on one core (this project's CI machine, 4 sequences of 2,000 tokens, 8 heads of 64, d_state 64,
Q = 64): see bench/bench_prefill.py."""

from __future__ import annotations

import torch

from gpu_worker.model.packed_prefill import PackedPrefillIndex, PackedScan, carry_states, packed_ssd_scan

# Largest total log-decay -sum(dt * A) of one scan chunk for the factored form: its factors reach
# exp(+-60) ~ 1e+-26, well inside float32's normal range (1e+-38), with room for the values they scale.
MAX_CHUNK_LOG_DECAY = 120.0


def packed_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    initial: torch.Tensor, index: PackedPrefillIndex,
) -> PackedScan:  # fmt: skip
    """`packed_ssd_scan`'s result (same arguments and shapes), in the factored form when every chunk's
    decay allows it."""
    return factored_ssd_scan(x, dt, A, B, C, D, initial, index) or packed_ssd_scan(x, dt, A, B, C, D, initial, index)


def factored_ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    initial: torch.Tensor, index: PackedPrefillIndex,
) -> PackedScan | None:  # fmt: skip
    """The scan in factored form (module docstring), or None when a chunk decays too much for it.

    x [Tp, H, P], dt [Tp, H] (softplus'd, clamped), A [H], B/C [Tp, G, N], D [H], initial [S, H, P, N]."""
    num_heads, head_dim = x.shape[1], x.shape[2]
    groups, state_size = B.shape[1], B.shape[2]
    width = num_heads // groups * head_dim  # channels of one group: its heads x P
    q, n_chunks = index.chunk_size, index.num_chunks
    dt = dt.float()

    def to_scan(t: torch.Tensor) -> torch.Tensor:  # [Tp, ...] -> [N, Q, ...]; pad rows are zero
        out = t.new_zeros((n_chunks * q, *t.shape[1:]))
        return out.index_copy_(0, index.unscan_rows, t).view(n_chunks, q, *t.shape[1:])

    a_cum = torch.cumsum(to_scan(dt * A.float()[None, :]), dim=1)  # [c, q, h], non-increasing along q
    a_last = a_cum[:, -1]  # [c, h]
    if bool((a_last < -MAX_CHUNK_LOG_DECAY).any()):
        return None
    ref = a_last * 0.5  # [c, h]
    w_in = torch.exp(ref[:, None, :] - a_cum)  # [c, q, h]
    w_out = torch.exp(a_cum - ref[:, None, :])
    xs = to_scan(x.float()) * (to_scan(dt) * w_in)[..., None]  # [c, q, h, p]: dt x, scaled to the reference

    def by_group(t: torch.Tensor, cols: int) -> torch.Tensor:  # [c, q, g * cols] -> [c * g, q, cols]
        return t.view(n_chunks, q, groups, cols).transpose(1, 2).reshape(n_chunks * groups, q, cols)

    Bg = by_group(to_scan(B.float()).view(n_chunks, q, -1), state_size)  # [c*g, q, n]
    Cg = by_group(to_scan(C.float()).view(n_chunks, q, -1), state_size)
    xg = by_group(xs.view(n_chunks, q, -1), width)  # [c*g, q, k*p]; views when g == 1

    # each chunk's own end state from zero: exp(a_last - r) (xs^T B), with a_last - r = r
    own = torch.bmm(xg.transpose(1, 2), Bg).view(n_chunks, num_heads, head_dim, state_size)
    own.mul_(torch.exp(ref)[:, :, None, None])
    starts, finals = carry_states(own, torch.exp(a_last), initial.float(), index)

    # outputs before w_out: tril(C B^T) @ xs + C @ (exp(r) S_start)^T, one GEMM pair per chunk and group
    cb = torch.bmm(Cg, Bg.transpose(1, 2)).tril_()  # [c*g, l, s]
    from_start = (starts * torch.exp(ref)[:, :, None, None]).view(n_chunks * groups, width, state_size)
    y = torch.baddbmm(torch.bmm(cb, xg), Cg, from_start.transpose(1, 2))  # [c*g, q, k*p]
    y = y.view(n_chunks, groups, q, width).transpose(1, 2).reshape(n_chunks * q, num_heads, head_dim)
    rows = index.unscan_rows
    w = w_out.view(n_chunks * q, num_heads).index_select(0, rows)[..., None]  # [Tp, h, 1]
    out = torch.addcmul(x.float() * D.float()[None, :, None], y.index_select(0, rows), w)
    return PackedScan(y=out, chunk_start_states=starts, final_states=finals)
