"""Attention in key tiles (gpu_worker.model.backends.cpu.tiled_attention): the tiled result against a plain
masked softmax over the whole context for prefill chunks (tiles across the chunk's start and its own keys)
and decode rows (pages consecutive and scattered); a workspace small enough to force tiles, through the
model, against transformers at the parity tolerance; the tile sizing rule."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.model.attention import PagedAttention
from gpu_worker.model.backends.cpu.tiled_attention import (
    KEY_GRID,
    key_tile_tokens,
    page_key_values,
    slot_key_values,
    tile_bytes_per_key,
    tile_bytes_per_query,
    tiled_attention,
    untiled_bytes,
)
from tests.model.model_helpers import hf_logits, make_runner, run_schedule
from tests.model.test_chunk_attention import reference

TOL = 1e-4  # the parity tests' tolerance


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 90), start=st.sampled_from([0, 1, 7, 64, 200]), tile=st.sampled_from([1, 3, 16, 50]),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3]), seed=st.integers(0, 1000))  # fmt: skip
def test_tiles_match_a_masked_softmax(length, start, tile, kv_heads, group, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    d = 16
    q = torch.randn(length, kv_heads * group, d, generator=g)
    k_cache = torch.randn(start + length + 40, kv_heads, d, generator=g)
    v_cache = torch.randn(start + length + 40, kv_heads, d, generator=g)
    slots = torch.randperm(k_cache.shape[0], generator=g)[: start + length]  # scattered, as pages are
    out = tiled_attention(q, slot_key_values(k_cache, v_cache, slots), start, d**-0.5, tile)
    assert out.shape == q.shape
    assert (out - reference(q, k_cache[slots], v_cache[slots], start, d**-0.5)).abs().max().item() <= 1e-5


def test_decode_rows_in_tiles_on_consecutive_and_scattered_pages() -> None:
    g = torch.Generator().manual_seed(0)
    page, kvh, d, length = 4, 2, 16, 37
    k_cache, v_cache = torch.randn(64, kvh, d, generator=g), torch.randn(64, kvh, d, generator=g)
    q = torch.randn(1, 2 * kvh, d, generator=g)
    scattered = torch.tensor([9, 2, 14, 0, 7, 3, 11, 5, 1, 15])
    for pages, first in ((torch.arange(3, 13), 12), (scattered, None)):
        slots = (pages[:, None] * page + torch.arange(page)).reshape(-1)[:length]
        want = reference(q, k_cache[slots], v_cache[slots], length - 1, d**-0.5)
        for tile in (5, 16, 36):
            out = tiled_attention(q, page_key_values(k_cache, v_cache, pages, page, first), length - 1, d**-0.5, tile)
            assert (out - want).abs().max().item() <= 1e-5, (first, tile)


def test_a_small_workspace_tiles_prefill_and_decode_and_matches_transformers(checkpoint) -> None:
    """A workspace of a few KB: every chunk past the first attends in tiles of one grid (KEY_GRID keys), and
    so do decode rows past a grid; logits stay at the parity tolerance."""
    hf, path = checkpoint
    runner = make_runner(path, page_size=16)
    for module in runner.model.modules():
        if isinstance(module, PagedAttention):
            module.workspace_bytes = 4096
            module.decode_long_context_tokens = 16
    ids = torch.randint(0, hf.config.vocab_size, (700,), generator=torch.Generator().manual_seed(5)).tolist()
    schedule = [300, 260, 120, *[1] * 20]  # 300 and 260 cross a grid; decodes over 680..699 keys (3 tiles)
    diff = (run_schedule(runner, ids, schedule) - hf_logits(hf, ids)).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff}"


def test_the_tile_fits_the_workspace() -> None:
    heads, kvh, d, es = 32, 8, 128, 2
    per_key, per_query = tile_bytes_per_key(heads, kvh, d, es), tile_bytes_per_query(heads, d)
    workspace = 200 << 20
    tile = key_tile_tokens(workspace, 1024, heads, kvh, d, es)
    assert tile % KEY_GRID == 0 and tile * per_key + 1024 * per_query <= workspace
    assert (tile + KEY_GRID) * per_key + 1024 * per_query > workspace  # the largest such tile
    assert key_tile_tokens(1, 1024, heads, kvh, d, es) == KEY_GRID  # never under one grid
    # the untiled paths grow with the context: 60,000 keys need far more than a 4,096-key context
    assert untiled_bytes(1024, 60_000, heads, kvh, d, es) > 10 * untiled_bytes(1024, 4096, heads, kvh, d, es)
