"""Causal attention of one prefill chunk over its whole context, on CPU's flash kernel.

A chunk's queries sit at positions [start, start + L) and see keys [0, start + L): every key before
the chunk, and the chunk's own keys causally. SDPA's `is_causal` aligns the mask top-left (query i
sees keys <= i), which is right only for start == 0; a dense boolean mask instead sends SDPA to its
math kernel, which materialises [heads, L, start + L] scores (measured on one core, L = 2,048 over
6,048 keys with 2 KV heads in groups of 2: 609 ms, against 120 ms here). So the context is split in
two flash calls whose results merge by their log-sum-exps:

    prefix  queries x keys [0, start)          no mask
    chunk   queries x keys [start, start + L)  is_causal (top-left is right: both start at 0)
    out = (out_p * exp(lse_p - m) + out_c * exp(lse_c - m)) / (exp(lse_p - m) + exp(lse_c - m))

`aten::_scaled_dot_product_flash_attention_for_cpu` is the kernel SDPA itself dispatches to on CPU;
it is the one entry point that also returns the log-sum-exp. Chunks of at least 256 float32 queries
take `onednn_attention` instead (its GEMMs are faster than the flash kernel's on AMD CPUs)."""

from __future__ import annotations

import torch

from gpu_worker.model.backends.cpu.onednn_attention import onednn_chunk_attention, use_onednn_attention

_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def can_use_flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in _FLASH_DTYPES


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, L, d], k/v [1, H, S, d] -> (out [1, H, L, d], lse [1, H, L] float32)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [L, H, d] at positions [start, start + L); k/v [start + L, kv_heads, d] (the whole context).
    Returns [L, H, d] in q's dtype. GQA: head h reads KV head h // (H / kv_heads). Long float32
    chunks go to oneDNN's GEMMs instead (gpu_worker.model.backends.cpu.onednn_attention)."""
    if use_onednn_attention(q):
        return onednn_chunk_attention(q, k, v, start, scale)
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]  # [1, H, L, d]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]  # [1, H, S, d]
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    out_c, lse_c = _flash(qh, kh[:, :, start:], vh[:, :, start:], True, scale)
    if start == 0:
        return out_c[0].transpose(0, 1)
    out_p, lse_p = _flash(qh, kh[:, :, :start], vh[:, :, :start], False, scale)
    top = torch.maximum(lse_p, lse_c)
    w_p, w_c = torch.exp(lse_p - top)[..., None], torch.exp(lse_c - top)[..., None]  # [1, H, L, 1]
    out = (out_p.float() * w_p + out_c.float() * w_c) / (w_p + w_c)
    return out[0].transpose(0, 1).to(q.dtype)
