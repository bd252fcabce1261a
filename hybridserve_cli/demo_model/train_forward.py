"""A differentiable forward over the serving model's own parameters, for training the demo model.

The runner's forward (`gpu_worker.model.model.HybridForCausalLM.forward`) writes K/V and Mamba state into
pools in place and runs under inference mode, so autograd cannot pass through it. This module runs the
same parameters (same module tree; `gpu_worker.model.loader.checkpoint_tensors` turns them into a
checkpoint) over a dense batch of equal-length sequences that all start at position 0 with empty state:

    tokens [B, L] -> embed -> per block: x + mixer(norm(x)) -> final norm -> logits [B, L, V]

with the config's embedding, residual and logits multipliers applied as the runner applies them. It
reuses the runner's norms, MLP/MoE modules, RoPE tables and the SSD scan itself; only the pool
bookkeeping is replaced by its dense equivalent (a causal mask for attention, a zero-padded causal conv
for Mamba). `tests/model/test_default_model.py` checks it against the runner on the committed weights."""

from __future__ import annotations

import functools
from typing import cast

import torch
import torch.nn.functional as F

from gpu_worker.model.attention import PagedAttention
from gpu_worker.model.layers import apply_rope, rope_cos_sin
from gpu_worker.model.mamba2 import Mamba2Mixer
from gpu_worker.model.model import Block, HybridForCausalLM
from gpu_worker.model.ssd import ssd_scan


def dense_attention(
    attn: PagedAttention, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
) -> torch.Tensor:
    """Causal GQA over whole sequences: h [B, L, hidden] -> [B, L, hidden]; no RoPE when cos/sin are None.

    Query head i reads KV head i // group, as in the runner's grouped layout; softmax scale as the runner's."""
    b, n, _ = h.shape
    q = attn.q_proj(h).view(b * n, attn.num_heads, attn.head_dim)
    k = attn.k_proj(h).view(b * n, attn.num_kv_heads, attn.head_dim)
    if cos is not None and sin is not None:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v = attn.v_proj(h).view(b, n, attn.num_kv_heads, attn.head_dim)
    q = q.view(b, n, attn.num_heads, attn.head_dim).transpose(1, 2)  # [B, heads, L, d]
    k = k.view(b, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2).repeat_interleave(attn.group, dim=1)
    v = v.transpose(1, 2).repeat_interleave(attn.group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)  # [B, heads, L, d]
    projected: torch.Tensor = attn.o_proj(out.transpose(1, 2).reshape(b, n, attn.num_heads * attn.head_dim))
    return projected


def dense_mamba(mixer: Mamba2Mixer, h: torch.Tensor) -> torch.Tensor:
    """Mamba2 over whole sequences from a zero state: h [B, L, hidden] -> [B, L, hidden].

    The conv input is left-padded with K-1 zeros (the runner's zeroed conv state); the scan is the
    runner's `ssd_scan`, mapped over the batch."""
    b, n, _ = h.shape
    z, xbc, dt = mixer.in_proj(h).split([mixer.d_inner, mixer.conv_dim, mixer.num_heads], dim=-1)
    dt = torch.clamp(F.softplus(dt.float() + mixer.dt_bias.float()), mixer.dt_min, mixer.dt_max)  # [B, L, H]
    A = -torch.exp(mixer.A_log.float())  # [H]
    keep = mixer.conv1d.weight.shape[-1] - 1
    window = F.pad(xbc.transpose(1, 2), (keep, 0))  # [B, conv_dim, K-1+L]
    conv = F.conv1d(window, mixer.conv1d.weight, mixer.conv1d.bias, groups=mixer.conv_dim)  # [B, conv_dim, L]
    xbc = F.silu(conv.transpose(1, 2))  # [B, L, conv_dim]
    gn = mixer.num_groups * mixer.state_size
    x = xbc[..., : mixer.d_inner].reshape(b, n, mixer.num_heads, mixer.head_dim)
    B = xbc[..., mixer.d_inner : mixer.d_inner + gn].reshape(b, n, mixer.num_groups, mixer.state_size)
    C = xbc[..., mixer.d_inner + gn :].reshape(b, n, mixer.num_groups, mixer.state_size)
    start = torch.zeros(b, mixer.num_heads, mixer.head_dim, mixer.state_size, device=h.device)
    scan = functools.partial(ssd_scan, chunk_size=mixer.chunk_size)
    y, _ = torch.vmap(scan, in_dims=(0, 0, None, 0, 0, None, 0))(x, dt, A, B, C, mixer.D, start)  # [B, L, H, P]
    y = mixer.norm(y.reshape(b * n, mixer.d_inner), z.reshape(b * n, mixer.d_inner)).to(h.dtype)
    out: torch.Tensor = mixer.out_proj(y.view(b, n, mixer.d_inner))
    return out


def dense_logits(model: HybridForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [B, L] (every row starts at position 0) -> logits [B, L, vocab] (float32)."""
    c = model.config
    hidden = model.embed(input_ids)  # [B, L, hidden]
    if c.embedding_multiplier != 1.0:
        hidden = hidden * c.embedding_multiplier
    b, n, _ = hidden.shape
    cos = sin = None
    if c.rotary_dim:
        positions = torch.arange(n, device=input_ids.device).repeat(b)  # packed [B * L], row-major
        cos, sin = rope_cos_sin(positions, model.inv_freq, hidden.dtype)
    for module in model.blocks:
        block = cast(Block, module)
        h = block.norm(hidden)
        if block.kind == "attention":
            h = dense_attention(cast(PagedAttention, block.mixer), h, cos, sin)
        elif block.kind == "mamba":
            h = dense_mamba(cast(Mamba2Mixer, block.mixer), h)
        else:
            h = block.mixer(h.reshape(b * n, -1)).view(b, n, -1)  # MLP / MoE: per token, no state
        hidden = hidden + (h if c.residual_multiplier == 1.0 else h * c.residual_multiplier)
    return model.compute_logits(model.final_norm(hidden))


def next_byte_loss(model: HybridForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per token) of predicting windows[:, 1:] from windows[:, :-1]."""
    logits = dense_logits(model, windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
