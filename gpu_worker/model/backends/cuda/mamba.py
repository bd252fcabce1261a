# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (`@triton.jit` kernels take pointers and tl.constexpr values that have no Python types; their callers
# in ops.py stay strict.)
"""Mamba2 per-token work in Triton: causal-conv window update (decode), causal conv over packed varlen
prefill, and the selective state update (decode) with D and the z gate.

From the Mamba-2 recurrence (H heads of P channels, state size N, head h reads B/C group h // (H/G)):
    conv   u_t = silu(bias + sum_k w[k] * xBC_{t-K+1+k})   over a window continuing the row's last K-1 inputs
    SSM    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T     y_t = S_t C_t + D_h x_t     y_t *= silu(z_t)
State rows are updated in place; a row index < 0 marks a padded batch row (nothing read or written).
Every kernel that rewrites what it read calls tl.debug_barrier() between its loads and its stores, so
no thread of the program can see a half-updated row (threads may hold replicated elements)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONV_BLOCK_C = 128  # channels per conv program
CONV_BLOCK_T = 32  # tokens per step of the varlen conv loop
SSM_BLOCK_P = 16  # head channels per state-update program


@triton.jit
def _conv_update_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, out_ptr, slots_ptr,
    stride_xb, stride_sr, stride_sc, stride_wc, stride_ob, CONV_DIM,
    KW: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    c_mask = offs_c < CONV_DIM
    if slot < 0:  # a padded row: zeros out, state untouched
        tl.store(out_ptr + b * stride_ob + offs_c, tl.zeros([BLOCK_C], out_ptr.dtype.element_ty), mask=c_mask)
        return
    offs_k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + b * stride_xb + offs_c, mask=c_mask, other=0.0)
    row = state_ptr + slot * stride_sr + offs_c[:, None] * stride_sc
    # window[:, k] = state[:, k] for k < K-1, x for k = K-1; shifted[:, k] = window[:, k + 1]
    in_state = (offs_k[None, :] < KW - 1) & c_mask[:, None]
    window = tl.load(row + offs_k[None, :], mask=in_state, other=0.0)
    window = tl.where(offs_k[None, :] == KW - 1, x[:, None], window)
    shift_in_state = (offs_k[None, :] + 1 < KW - 1) & c_mask[:, None]
    shifted = tl.load(row + offs_k[None, :] + 1, mask=shift_in_state, other=0.0)
    shifted = tl.where(offs_k[None, :] + 1 == KW - 1, x[:, None], shifted)
    w = tl.load(w_ptr + offs_c[:, None] * stride_wc + offs_k[None, :], mask=(offs_k[None, :] < KW) & c_mask[:, None],
                other=0.0)  # fmt: skip
    acc = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    tl.debug_barrier()
    tl.store(row + offs_k[None, :], shifted, mask=(offs_k[None, :] < KW - 1) & c_mask[:, None])
    tl.store(out_ptr + b * stride_ob + offs_c, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _conv_varlen_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, out_ptr, spans_ptr,
    stride_xt, stride_sr, stride_sc, stride_wc, stride_ot, CONV_DIM,
    KW: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    span = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    token_start = tl.load(spans_ptr + span * 3)
    num_tokens = tl.load(spans_ptr + span * 3 + 1)
    slot = tl.load(spans_ptr + span * 3 + 2).to(tl.int64)
    c_mask = offs_c < CONV_DIM
    row = state_ptr + slot * stride_sr + offs_c[None, :] * stride_sc  # [1, C] pointers to column 0
    bias = tl.zeros([BLOCK_C], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    for t_block in range(0, num_tokens, BLOCK_T):
        offs_t = t_block + tl.arange(0, BLOCK_T)  # position within the chunk
        t_mask = (offs_t < num_tokens)[:, None] & c_mask[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32) + bias[None, :]
        for k in tl.static_range(KW):
            src = offs_t + (k - (KW - 1))  # < 0: column KW - 1 + src of the state row
            from_x = t_mask & (src >= 0)[:, None]
            from_state = t_mask & (src < 0)[:, None]
            xv = tl.load(x_ptr + (token_start + src)[:, None].to(tl.int64) * stride_xt + offs_c[None, :],
                         mask=from_x, other=0.0)  # fmt: skip
            sv = tl.load(row + (KW - 1 + src)[:, None], mask=from_state, other=0.0)
            w_k = tl.load(w_ptr + offs_c * stride_wc + k, mask=c_mask, other=0.0).to(tl.float32)
            acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w_k[None, :]
        out_off = (token_start + offs_t)[:, None].to(tl.int64) * stride_ot + offs_c[None, :]
        tl.store(out_ptr + out_off, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=t_mask)
    # the new row: window position num_tokens + j, window = [state (K-1) | chunk (num_tokens)]
    offs_j = tl.arange(0, BLOCK_K)
    idx = num_tokens + offs_j
    j_mask = (offs_j < KW - 1)[:, None] & c_mask[None, :]
    from_state = j_mask & (idx < KW - 1)[:, None]
    from_x = j_mask & (idx >= KW - 1)[:, None]
    sv = tl.load(row + idx[:, None], mask=from_state, other=0.0)
    x_rows = (token_start + idx - (KW - 1))[:, None].to(tl.int64)
    xv = tl.load(x_ptr + x_rows * stride_xt + offs_c[None, :], mask=from_x, other=0.0)
    tl.debug_barrier()
    tl.store(row + offs_j[:, None], tl.where(from_state, sv, xv.to(sv.dtype)), mask=j_mask)


@triton.jit
def _ssm_update_kernel(
    state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, y_ptr, slots_ptr,
    stride_sr, stride_sh, stride_sp, stride_xb, stride_xh, stride_dtb, stride_bb, stride_bg,
    stride_cb, stride_cg, stride_zb, stride_zh, stride_yb, stride_yh,
    HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_STATE: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p_mask = offs_p < HEAD_DIM
    if slot < 0:  # a padded row: zeros out, state untouched
        tl.store(y_ptr + b * stride_yb + h * stride_yh + offs_p, tl.zeros([BLOCK_P], tl.float32), mask=p_mask)
        return
    g = h // HEADS_PER_GROUP
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < D_STATE
    s_ptrs = state_ptr + slot * stride_sr + h * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :]
    s_mask = p_mask[:, None] & n_mask[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)
    x = tl.load(x_ptr + b * stride_xb + h * stride_xh + offs_p, mask=p_mask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b * stride_dtb + h).to(tl.float32)
    a = tl.load(a_ptr + h).to(tl.float32)
    bv = tl.load(b_ptr + b * stride_bb + g * stride_bg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + b * stride_cb + g * stride_cg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    s = s * tl.exp(dt * a) + (dt * x)[:, None] * bv[None, :]
    y = tl.sum(s * cv[None, :], axis=1)
    if HAS_D:
        y += tl.load(d_ptr + h).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(z_ptr + b * stride_zb + h * stride_zh + offs_p, mask=p_mask, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    tl.debug_barrier()
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=s_mask)
    tl.store(y_ptr + b * stride_yb + h * stride_yh + offs_p, y, mask=p_mask)


def _pow2(n: int) -> int:
    return int(triton.next_power_of_2(n))


def conv_update(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor
) -> torch.Tensor:
    """See `reference.conv_update`. x [b, C] (last dim contiguous), conv_state [rows, C, K-1] with the
    K-1 axis contiguous, weight [C, K] contiguous, slots [b]. Returns [b, C] in x's dtype."""
    b, conv_dim = x.shape
    out = torch.empty_like(x)
    if b == 0:
        return out
    kw = weight.shape[1]
    grid = (b, triton.cdiv(conv_dim, CONV_BLOCK_C))
    _conv_update_kernel[grid](
        x, conv_state, weight, bias if bias is not None else weight, out, slots, x.stride(0),
        conv_state.stride(0), conv_state.stride(1), weight.stride(0), out.stride(0), conv_dim, KW=kw,
        HAS_BIAS=bias is not None, BLOCK_C=CONV_BLOCK_C, BLOCK_K=_pow2(kw),
    )  # fmt: skip
    return out


def conv_varlen(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    spans: torch.Tensor,
) -> torch.Tensor:
    """See `reference.conv_varlen`. x [T, C] packed (last dim contiguous); spans [S, 3] int64 rows
    (token_start, num_tokens, state_slot). Returns [T, C] in x's dtype (rows outside spans untouched)."""
    conv_dim = x.shape[1]
    out = torch.empty_like(x)
    if spans.shape[0] == 0:
        return out
    kw = weight.shape[1]
    grid = (spans.shape[0], triton.cdiv(conv_dim, CONV_BLOCK_C))
    _conv_varlen_kernel[grid](
        x, conv_state, weight, bias if bias is not None else weight, out, spans, x.stride(0),
        conv_state.stride(0), conv_state.stride(1), weight.stride(0), out.stride(0), conv_dim, KW=kw,
        HAS_BIAS=bias is not None, BLOCK_C=CONV_BLOCK_C, BLOCK_T=CONV_BLOCK_T, BLOCK_K=_pow2(kw),
    )  # fmt: skip
    return out


def ssm_update(
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `reference.ssm_update`. Last dims contiguous: ssm_state [rows, H, P, N] float32, x/z [b, H, P],
    dt [b, H], B/C [b, G, N]. Returns y [b, H, P] float32 (written into `out` when given)."""
    b, heads, head_dim = x.shape
    state_size = ssm_state.shape[-1]
    y = torch.empty(b, heads, head_dim, dtype=torch.float32, device=x.device) if out is None else out
    if b == 0:
        return y
    zz = z if z is not None else x
    grid = (b, heads, triton.cdiv(head_dim, SSM_BLOCK_P))
    _ssm_update_kernel[grid](
        ssm_state, x, dt, A, B, C, D if D is not None else A, zz, y, slots,
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), x.stride(0), x.stride(1), dt.stride(0),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1), zz.stride(0), zz.stride(1), y.stride(0), y.stride(1),
        HEADS_PER_GROUP=heads // B.shape[1], HEAD_DIM=head_dim, D_STATE=state_size, HAS_D=D is not None,
        HAS_Z=z is not None, BLOCK_P=SSM_BLOCK_P, BLOCK_N=_pow2(state_size),
    )  # fmt: skip
    return y
