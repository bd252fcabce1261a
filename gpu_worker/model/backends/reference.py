"""The contract of every Triton kernel, written as plain torch loops: the oracle of the kernel tests.

Shapes and conventions shared with the kernels (see `attention.py`, `mamba.py`):
    KV cache        k, v [num_slots, kv_heads, head_dim]; flat slot = page_id * page_size + offset
    state rows      conv [rows, conv_dim, K-1] (model dtype), ssm [rows, H, P, N] (float32)
    slot -1         a padded batch row (CUDA-graph buckets): nothing is read or written for it
Spans of a packed prefill: (token_start, num_tokens, start_pos, ...) per sequence, tokens back to back.
These loops are slow on purpose: one sequence, one head at a time, nothing fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k, v [T, kv_heads, d] into the caches at flat `slots` [T]; rows with slot < 0 are skipped."""
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache[slot] = k[t]
            v_cache[slot] = v[t]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, d] over k, v [ctx, d]; query i sees keys at positions <= q_pos[i]. float32 math."""
    scores = (q.float() @ k.float().t()) * scale
    keep = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v.float()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """q [b, heads, d]; sequence i attends over its first seq_lens[i] positions, found through
    page_table[i] ([b, max_pages]). Rows with seq_len 0 give zeros. Returns [b, heads, d] in q's dtype."""
    b, heads, d = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(b, heads, d, dtype=torch.float32)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        pos = torch.arange(n)
        slots = page_table[i].long()[pos // page_size] * page_size + pos % page_size
        for h in range(heads):
            k, v = k_cache[slots, h // group], v_cache[slots, h // group]
            out[i, h] = _attend(q[i, h][None], k, v, torch.tensor([n - 1]), scale)[0]
    return out.to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: list[tuple[int, int, int]],
    slot_maps: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """q [T, heads, d] packed; span j = (token_start, num_tokens, start_pos) attends causally over
    [0, start_pos + num_tokens) whose flat slots are slot_maps[j]. Rows outside spans are zero."""
    heads = q.shape[1]
    group = heads // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for (t0, n, start), slots in zip(spans, slot_maps, strict=True):
        q_pos = torch.arange(start, start + n)
        for h in range(heads):
            k, v = k_cache[slots.long(), h // group], v_cache[slots.long(), h // group]
            out[t0 : t0 + n, h] = _attend(q[t0 : t0 + n, h], k, v, q_pos, scale)
    return out.to(q.dtype)


def conv_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One decode token per row: x [b, C], window = [state row, x] ([C, K]); returns silu(window . w + bias)
    [b, C] in x's dtype and shifts x into the row. weight [C, K]. Rows with slot < 0: zeros, no write."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        window = torch.cat([conv_state[slot], x[i][:, None]], dim=-1).float()  # [C, K]
        acc = (window * weight.float()).sum(-1) + (bias.float() if bias is not None else 0.0)
        out[i] = F.silu(acc)
        conv_state[slot] = window[:, 1:].to(conv_state.dtype)
    return out.to(x.dtype)


def conv_varlen(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    spans: list[tuple[int, int, int]],
) -> torch.Tensor:
    """Packed prefill: span (token_start, num_tokens, state_slot) continues from its conv state row.
    Returns silu(causal conv) [T, C] (rows outside spans zero) and leaves the last K-1 inputs in the row."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    keep = conv_state.shape[-1]
    for t0, n, slot in spans:
        window = torch.cat([conv_state[slot], x[t0 : t0 + n].t()], dim=-1).float()  # [C, K-1+n]
        conv = F.conv1d(window[None], weight.float()[:, None, :], bias.float() if bias is not None else None,
                        groups=x.shape[1])[0]  # fmt: skip
        out[t0 : t0 + n] = F.silu(conv.t())
        conv_state[slot] = window[:, window.shape[-1] - keep :].to(conv_state.dtype)
    return out.to(x.dtype)


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
) -> torch.Tensor:
    """One recurrence step per row, in float32: S = exp(dt A) S + dt x B^T; y = S C + D x; y *= silu(z).

    ssm_state [rows, H, P, N]; x, z [b, H, P]; dt [b, H] (softplus'd); A, D [H]; B, C [b, G, N].
    Returns y [b, H, P] float32; rows with slot < 0 give zeros and leave the state alone."""
    b, heads, _ = x.shape
    per_group = heads // B.shape[1]
    y = torch.zeros(x.shape, dtype=torch.float32)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for h in range(heads):
            g = h // per_group
            s = ssm_state[slot, h].float() * torch.exp(dt[i, h].float() * A[h].float())
            s = s + (dt[i, h].float() * x[i, h].float())[:, None] * B[i, g].float()[None, :]
            ssm_state[slot, h] = s
            out = s @ C[i, g].float()
            if D is not None:
                out = out + D[h].float() * x[i, h].float()
            if z is not None:
                out = out * F.silu(z[i, h].float())
            y[i, h] = out
    return y
