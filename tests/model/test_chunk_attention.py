"""The prefill chunk's attention on CPU (the flash kernel, two calls merged by log-sum-exp; long chunks on
oneDNN GEMMs by query blocks) against a plain masked softmax over the whole context."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.model.backends.cpu.chunk_attention import chunk_attention
from gpu_worker.model.backends.cpu.linear import onednn_available
from gpu_worker.model.backends.cpu.onednn_attention import MIN_QUERIES, use_onednn_attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [S, H, d]
    scores = torch.einsum("lhd,shd->hls", q.double(), k.double()) * scale
    visible = torch.arange(k.shape[0])[None, :] <= torch.arange(start, start + q.shape[0])[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hls,shd->lhd", probs, v.double()).float()


@settings(max_examples=30, deadline=None)
@given(length=st.integers(1, 70), start=st.sampled_from([0, 1, 5, 64, 129]), kv_heads=st.sampled_from([1, 2, 4]),
       group=st.sampled_from([1, 2, 3]), seed=st.integers(0, 1000))  # fmt: skip
def test_chunk_attention_matches_a_masked_softmax(length, start, kv_heads, group, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    d = 16
    q = torch.randn(length, kv_heads * group, d, generator=g)
    k = torch.randn(start + length, kv_heads, d, generator=g)
    v = torch.randn(start + length, kv_heads, d, generator=g)
    out = chunk_attention(q, k, v, start, d**-0.5)
    assert out.shape == q.shape
    assert (out - reference(q, k, v, start, d**-0.5)).abs().max().item() <= 1e-5


@settings(max_examples=12, deadline=None)
@given(length=st.integers(MIN_QUERIES, MIN_QUERIES + 300), start=st.sampled_from([0, 7, 256, 300]),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3]), seed=st.integers(0, 1000))  # fmt: skip
def test_long_chunks_take_onednn_and_match_a_masked_softmax(length, start, kv_heads, group, seed) -> None:
    """Query blocks, key padding to the grid and causal masks across block edges, against the plain softmax."""
    g = torch.Generator().manual_seed(seed)
    d = 16
    q = torch.randn(length, kv_heads * group, d, generator=g)
    k = torch.randn(start + length, kv_heads, d, generator=g)
    v = torch.randn(start + length, kv_heads, d, generator=g)
    assert use_onednn_attention(q) == onednn_available()
    out = chunk_attention(q, k, v, start, d**-0.5)
    assert out.shape == q.shape
    assert (out - reference(q, k, v, start, d**-0.5)).abs().max().item() <= 1e-5
