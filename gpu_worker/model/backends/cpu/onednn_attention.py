"""Causal attention of one long prefill chunk on CPU with oneDNN GEMMs, one block of queries at a time.

CPU's flash kernel (`chunk_attention`) runs its GEMMs through MKL, which takes its AVX2 path on AMD
processors (see `linear`). Here each block of QUERY_BLOCK queries, for each KV head, is

    scores = (scale * Q_blk) @ K[:n]^T      one oneDNN GEMM, the group's query heads stacked as rows
    P      = softmax(scores masked causally)  torch's fused softmax over [group * block, n]
    out    = P @ V[:n]                        one oneDNN GEMM

with n the keys the block's last query sees, rounded up to KEY_GRID (the padded keys are zero and
masked), and the block's rows rounded up to ROW_GRID (zero queries, dropped), so that GEMM shapes repeat
from step to step and oneDNN reuses its compiled kernels instead of building (and keeping) new ones. Scores
are materialised per block ([group * 256, n] floats, under 8 MB for 4,096 keys), which on one core costs
less than the GEMM time it saves. Measured on one core of this project's CI machine, float32, 4 query
heads over 2 KV heads of 64, a fresh prompt: 1,000 tokens 8.1 -> 5.6 ms, 2,000 tokens 27.9 -> 17.3 ms,
3,000 tokens 58.1 -> 36.7 ms per layer.

`use_onednn_attention` says when it applies: CPU, float32, oneDNN present, at least MIN_QUERIES queries
(below, the flash kernel's single call is cheaper than the per-block Python)."""

from __future__ import annotations

import torch

from gpu_worker.model.backends.cpu.linear import onednn_available

QUERY_BLOCK = 256  # queries per block (rows of the scores GEMM per query head)
KEY_GRID = 256  # key counts are padded up to a multiple of this: GEMM shapes repeat across steps
MIN_QUERIES = 256  # shorter chunks take the flash kernel
# A block's query rows are padded to a multiple of this: oneDNN keeps what it builds for each GEMM shape it
# meets (measured: ~1 MB a shape, kept after malloc_trim, primitive cache or not), so an unpadded chunk
# length of each remainder added ~1 MB for good; padded, a block takes one of QUERY_BLOCK / ROW_GRID shapes
ROW_GRID = 16


def use_onednn_attention(q: torch.Tensor) -> bool:
    """Whether `onednn_chunk_attention` applies to the chunk's queries q [L, H, d]."""
    return q.shape[0] >= MIN_QUERIES and q.device.type == "cpu" and q.dtype == torch.float32 and onednn_available()


def onednn_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [L, H, d] at positions [start, start + L); k/v [start + L, kv_heads, d] (the whole context).
    Returns [L, H, d]: query i sees keys [0, start + i]. GQA: head h reads KV head h // (H / kv_heads)."""
    length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    num_keys = start + length
    padded = -(-num_keys // KEY_GRID) * KEY_GRID
    keys = k.new_zeros(num_kv_heads, padded, head_dim)  # [kvh, S', d], zero past the context
    keys[:, :num_keys] = k.transpose(0, 1)
    values_t = v.new_zeros(num_kv_heads, head_dim, padded)  # [kvh, d, S']: V^T, the second GEMM's weight
    values_t[:, :, :num_keys] = v.permute(1, 2, 0)
    rows_padded = -(-length // ROW_GRID) * ROW_GRID  # zero queries past the chunk: their rows are dropped
    queries = q.new_zeros(num_kv_heads, group, rows_padded, head_dim)  # [kvh, g, L', d]
    queries[:, :, :length] = (q * scale).view(length, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    out = q.new_empty(length, num_kv_heads, group, head_dim)
    key_pos = torch.arange(padded, device=q.device)
    linear = torch.ops.mkldnn._linear_pointwise
    for first in range(0, length, QUERY_BLOCK):
        last = min(length, first + QUERY_BLOCK)
        rows, block_rows = last - first, min(rows_padded, first + QUERY_BLOCK) - first
        seen = -(-(start + last) // KEY_GRID) * KEY_GRID  # keys the block's last query sees, padded
        edge = start + first  # every query of the block sees keys [0, edge): only [edge, seen) needs a mask
        hidden = key_pos[None, edge:seen] > torch.arange(edge, edge + block_rows, device=q.device)[:, None]
        for j in range(num_kv_heads):
            block = queries[j, :, first : first + block_rows].reshape(group * block_rows, head_dim)
            scores = linear(block, keys[j, :seen], None, "none", [], "")  # [g * block_rows, seen]
            scores.view(group, block_rows, seen)[:, :, edge:].masked_fill_(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            weight = values_t[j, :, :seen].contiguous()  # [d, seen]
            attended = linear(probs, weight, None, "none", [], "").view(group, block_rows, head_dim)
            out[first:last, j] = attended[:, :rows].transpose(0, 1)
    return out.view(length, num_heads, head_dim)
