"""The Mamba2 mixer's decode step between in_proj and out_proj, as one function for torch.compile.

Eager torch runs a decode step of the mixer as ~30 small ops, three of them full passes over the SSM
state (decay, rank-1 update, readout: 4 MiB each at 32 sequences of the tiny model). Compiled by
inductor, the same math becomes a few loops: the state is read by the readout and updated in place
(no copy of it), the conv window, dt, the gate and the grouped RMS norm fuse around it.
`gpu_worker.model.backends.cpu.compiled_decode` compiles it; the mixer's eager `_decode` stays the reference (same
equations, `ssd.ssm_step_`).

Per sequence i of the decode group (pool row r = rows[i]), heads h of P channels, state size N:
    z, xBC, dt      = split(zxbcdt[i])
    window          = [conv[r] | xBC]  (conv_dim x K);  conv[r] <- window[:, 1:]
    x, B, C         = split(silu(sum_k window[:, k] w[:, k] + b))
    dt              = clamp(softplus(dt + dt_bias), dt_min, dt_max);  dA = exp(dt * -exp(A_log))
    y_h             = dA_h S[r, h] C + dt_h x_h (B . C) + D_h x_h   (= S'[r, h] C + D_h x_h, read off the old S)
    S[r, h]         <- S' = dA_h S[r, h] + dt_h x_h B^T
    out             = norm_w * group_rms_norm(y * silu(z))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class MambaDims:
    """The mixer's static sizes and constants (the same for every Mamba layer of a model)."""

    d_inner: int  # H * P
    conv_dim: int  # d_inner + 2 * G * N
    num_heads: int  # H
    head_dim: int  # P
    num_groups: int  # G
    state_size: int  # N
    dt_min: float  # softplus(dt) is clamped to [dt_min, dt_max]
    dt_max: float
    eps: float  # gated RMS norm epsilon


def mamba_decode_step(
    zxbcdt: torch.Tensor,
    conv_rows: torch.Tensor,
    ssm_rows: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    dims: MambaDims,
) -> torch.Tensor:
    """zxbcdt [b, d_inner + conv_dim + H] (in_proj output) -> [b, d_inner] in zxbcdt's dtype (out_proj
    input). conv_rows [b, conv_dim, K-1] and ssm_rows [b, H, P, N] float32 are the decode group's state
    rows (contiguous views of the pool, or gathered copies), updated in place. conv_weight [conv_dim, K]."""
    d = dims
    b = zxbcdt.shape[0]
    z, x, B, C, dt, decay = decode_inputs(zxbcdt, conv_rows, conv_weight, conv_bias, dt_bias, A_log, dims)
    heads_per_group = d.num_heads // d.num_groups
    B = B[:, :, None, None, :].expand(b, d.num_groups, heads_per_group, 1, d.state_size)
    C = C[:, :, None, None, :].expand(b, d.num_groups, heads_per_group, 1, d.state_size)
    B, C = B.reshape(b, d.num_heads, 1, d.state_size), C.reshape(b, d.num_heads, 1, d.state_size)
    decay = decay[:, :, None]  # [b, H, 1]
    dtx = x * dt[:, :, None]  # [b, H, P]
    # y = (decay S + dtx B) . C, read off the old state: decay (S . C) + dtx (B . C). Computed from the new
    # state, inductor keeps that state in a buffer of its own (written twice, read again: four passes
    # over it); this way the readout is one read, the update one read and one write in place, no buffer
    y = decay * (ssm_rows * C).sum(dim=-1) + dtx * (B * C).sum(dim=-1) + x * D.float()[None, :, None]  # [b, H, P]
    ssm_rows.copy_(ssm_rows * decay[..., None] + dtx[..., None] * B)  # [b, H, P, N]
    return gated_norm(y.view(b, d.d_inner), z, norm_weight, dims)


def decode_inputs(
    zxbcdt: torch.Tensor,
    conv_rows: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    dims: MambaDims,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step up to the SSM: zxbcdt [b, width] -> z [b, d_inner] (the gate, zxbcdt's dtype) and, float32,
    x [b, H, P], B and C [b, G, N], dt and decay [b, H]; conv_rows [b, conv_dim, K-1] advanced in place."""
    d = dims
    b = zxbcdt.shape[0]
    z, xbc, dt = torch.split(zxbcdt, [d.d_inner, d.conv_dim, d.num_heads], dim=-1)
    window = torch.cat([conv_rows, xbc[:, :, None]], dim=-1)  # [b, conv_dim, K]
    conv = (window * conv_weight).sum(dim=-1)  # [b, conv_dim]
    conv_rows.copy_(window[:, :, 1:])
    if conv_bias is not None:
        conv = conv + conv_bias
    xbc = F.silu(conv)
    gn = d.num_groups * d.state_size
    x = xbc[:, : d.d_inner].float().view(b, d.num_heads, d.head_dim)
    B = xbc[:, d.d_inner : d.d_inner + gn].float().view(b, d.num_groups, d.state_size)
    C = xbc[:, d.d_inner + gn :].float().view(b, d.num_groups, d.state_size)
    dt = torch.clamp(F.softplus(dt.float() + dt_bias.float()), d.dt_min, d.dt_max)  # [b, H]
    decay = torch.exp(dt * -torch.exp(A_log.float()))  # [b, H]
    return z, x, B, C, dt, decay


def gated_norm(y: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, dims: MambaDims) -> torch.Tensor:
    """y [T, d_inner] float32, z [T, d_inner] (the gate, in the model's dtype) -> norm_w * group_rms_norm(y *
    silu(z)) in z's dtype (the mixer's GatedRMSNorm)."""
    d = dims
    h = y * F.silu(z.float())
    g = h.view(-1, d.num_groups, d.d_inner // d.num_groups)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + d.eps)
    return norm_weight * g.view(-1, d.d_inner).to(z.dtype)
