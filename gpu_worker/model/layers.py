"""Small building blocks shared by every family: RMS norms, the dense MLP and rotary embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model.config import Activation


class RMSNorm(nn.Module):
    """RMS norm computed in float32 and cast back (as the reference does)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GatedRMSNorm(nn.Module):
    """norm(y * silu(z)) with the RMS taken separately over each of `num_groups` channel groups."""

    def __init__(self, hidden_size: int, num_groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.num_groups = num_groups
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # y, z: [T, d_inner] -> [T, d_inner] in y's dtype
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        num_tokens, width = h.shape
        g = h.view(num_tokens, self.num_groups, width // self.num_groups)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(num_tokens, width).to(dtype)


class MLP(nn.Module):
    """down(act(up(x))). For `swiglu` the up projection is the fused [gate; up] and act is silu(gate) * up;
    for `relu2` it is relu(x)^2 (no gate)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: Activation, bias: bool) -> None:
        super().__init__()
        self.activation = activation
        width = 2 * intermediate_size if activation == "swiglu" else intermediate_size
        self.up_proj = nn.Linear(hidden_size, width, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(activate(self.up_proj(x), self.activation))
        return out


def activate(h: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The MLP nonlinearity on an up projection: [.., 2I] -> [.., I] for swiglu, [.., I] -> [.., I] for relu2."""
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return torch.square(F.relu(h))


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for absolute token positions: [T] -> two [T, rotary_dim] tensors (float32 math)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE on the leading `rotary_dim` dims of each head; the rest pass through.

    x: [T, heads, head_dim]; cos, sin: [T, rotary_dim]."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
