"""The gated RMS norm's fused float32 path (torch's RMS norm kernel) against the float32 formula it
replaces, for one group and several, decode-sized and prefill-sized row counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.model.layers import GatedRMSNorm


def _formula(norm: GatedRMSNorm, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    h = y.float() * F.silu(z.float())
    g = h.view(h.shape[0], norm.num_groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * g.view(h.shape).to(y.dtype)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_gated_norm_matches_the_formula(groups: int, rows: int) -> None:
    g = torch.Generator().manual_seed(rows * 10 + groups)
    norm = GatedRMSNorm(64, groups, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    zx = torch.randn(rows, 160, generator=g)
    y, z = torch.randn(rows, 64, generator=g) * 3, zx[:, 16:80]  # z a strided view, as the mixer's split
    y_before, z_before = y.clone(), z.clone()
    with torch.no_grad():
        got, want = norm(y, z), _formula(norm, y, z)
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item())
    assert torch.equal(y, y_before) and torch.equal(z, z_before)  # inputs untouched


def test_other_dtypes_keep_the_formula() -> None:
    norm = GatedRMSNorm(32, 2, 1e-5).to(torch.bfloat16)
    y = torch.randn(5, 32).to(torch.bfloat16)
    z = torch.randn(5, 32).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(norm(y, z), _formula(norm, y, z))
