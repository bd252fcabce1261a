# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (`@triton.jit` kernels take pointers and tl.constexpr values that have no Python types; their callers
# in ops.py stay strict.)
"""Paged attention in Triton: the KV write, decode over the page table, prefill of packed ragged chunks.

Written from the attention equations, softmax(q k^T * scale) v, with the streaming ("online") softmax:
keys are visited in blocks of BLOCK_N; per query row the running maximum m, normaliser l and weighted sum
acc are rescaled by exp(m_old - m_new) whenever a block raises the maximum, so the context never has to
fit in registers. Scores, m, l and acc are float32 whatever the cache dtype.

Index maps (see `reference.py` for the contract in torch):
    decode   program (row i, kv head)      keys [0, seq_lens[i]) at table[i, pos // page] * page + pos % page
    prefill  program (span j, head, block) queries [token_start + m * BLOCK_M, +BLOCK_M) of span j, keys
             [0, start_pos + end of the query block) at slot_map[map_offset + pos]; key pos <= query pos
A GQA group's query heads share one program in decode (the group is padded to 16 rows for tl.dot)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DECODE_BLOCK_N = 64  # keys per step of the decode loop
PREFILL_BLOCK_M = 64  # queries per prefill program
PREFILL_BLOCK_N = 64  # keys per step of the prefill loop


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, table_ptr, seq_lens_ptr,
    stride_qb, stride_qh, stride_cs, stride_ch, stride_ob, stride_oh, stride_tb, scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    qo_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < seq_len
        page = tl.load(table_ptr + b * stride_tb + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
        kv_off = slot[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]
        kv_mask = n_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if FP32:  # noqa: SIM108 (a constexpr branch; exact float32 products, no TF32 rounding)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G, N]
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if FP32:  # noqa: SIM108
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 (a padded row): zeros
    out_off = b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=qo_mask)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, slot_map_ptr, spans_ptr,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_ot, stride_oh, scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP32: tl.constexpr,
):  # fmt: skip
    span = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    token_start = tl.load(spans_ptr + span * 4)
    num_tokens = tl.load(spans_ptr + span * 4 + 1)
    start_pos = tl.load(spans_ptr + span * 4 + 2)
    map_offset = tl.load(spans_ptr + span * 4 + 3)
    if mb * BLOCK_M >= num_tokens:
        return
    kvh = h // GROUP
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < num_tokens
    qo_mask = m_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = (token_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0)
    q_pos = start_pos + offs_m
    end = start_pos + tl.minimum((mb + 1) * BLOCK_M, num_tokens)  # keys this query block can see
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, end, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < end
        slot = tl.load(slot_map_ptr + map_offset + pos, mask=n_mask, other=0).to(tl.int64)
        kv_off = slot[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]
        kv_mask = n_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if FP32:  # noqa: SIM108 (a constexpr branch)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, N]
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        # every query row sees key 0 in the first block, so m_i is finite from then on
        s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    out_off = rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=qo_mask)


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, int(triton.next_power_of_2(n)))


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k, v [T, kv_heads, d] (last dim contiguous) into the caches at `slots` [T]; slot < 0 is skipped."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=_pow2(kv_heads), BLOCK_D=_pow2(head_dim),
    )  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [b, heads, d] -> [b, heads, d]; see `reference.paged_decode_attention`. page_table [b, max_pages]
    (int32 or int64, last dim contiguous), seq_lens [b]. Writes into `out` when given."""
    b, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    group = heads // kv_heads
    _paged_decode_kernel[(b, kv_heads)](
        q, k_cache, v_cache, out, page_table, seq_lens, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), out.stride(0), out.stride(1), page_table.stride(0), scale, GROUP=group,
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_G=_pow2(group, 16), BLOCK_D=_pow2(head_dim, 16),
        BLOCK_N=DECODE_BLOCK_N, FP32=q.dtype == torch.float32,
    )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: torch.Tensor,
    slot_map: torch.Tensor,
    max_tokens: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, heads, d] packed. spans [S, 4] int64 rows (token_start, num_tokens, start_pos, map_offset):
    span j's context slots are slot_map[map_offset : map_offset + start_pos + num_tokens]. `max_tokens`
    bounds num_tokens (sizes the grid). Rows of q outside every span are left untouched in `out`."""
    heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q) if out is None else out
    num_spans = spans.shape[0]
    if num_spans == 0:
        return out
    grid = (num_spans, heads, triton.cdiv(max_tokens, PREFILL_BLOCK_M))
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, slot_map, spans, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), out.stride(0), out.stride(1), scale, GROUP=heads // k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, BLOCK_D=_pow2(head_dim, 16),
        FP32=q.dtype == torch.float32,
    )  # fmt: skip
    return out
