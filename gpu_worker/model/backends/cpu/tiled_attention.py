"""Attention over a long cached context in key tiles, merged by their log-sum-exps (the online softmax), so
that no temporary grows with the context beyond one tile.

The untiled paths gather the whole context's K and V (`k_cache[span.kv_slots]`, GQA-expanded copies, the
oneDNN path's padded and transposed copies) and the oneDNN path materialises [group * 256, context] scores
and probabilities per query block: for a 1,024-token chunk at position 59,000 that is hundreds of MB per
attention layer, more with every step of a long prompt. Here the keys [0, start + L) of a chunk at
positions [start, start + L) are visited `tile` at a time, each tile gathered from its slots alone:

    shared    keys [0, start + 1)          every query of the chunk sees them: no mask
    diagonal  keys [k0, k1), k0 > start    queries at positions >= k0 (rows [k0 - start, L)), is_causal
                                           (top-left alignment is right: both begin at position k0)

Each tile goes through CPU's flash kernel, which returns its output and log-sum-exp; the running result
is merged as  out = out * exp(lse - lse') + out_t * exp(lse_t - lse'),  lse' = log(exp(lse) + exp(lse_t)),
in float32. A decode row is the case L = 1 (all of its keys are shared). The result equals the untiled
softmax up to float rounding (tests/model/test_tiled_attention.py).

Bytes, per key of a tile: its K and V gathered (kv_heads * d each) and their GQA-expanded copies for the
flash kernel (heads * d each), in the cache's dtype. Per query, fixed whatever the tile: the float32
running output, the tile's output and the merge's temporaries (`TILE_QUERY_COPIES` of [heads, d]).
`key_tile_tokens` sizes the tile from a byte budget (the attention workspace, gpu_worker.runner.profile)."""

from __future__ import annotations

from collections.abc import Callable

import torch

KEY_GRID = 256  # tiles are a multiple of this many keys (the oneDNN path's key padding)
TILE_QUERY_COPIES = 4  # float32 [heads, d] copies per query a tiled call holds: running out, tile out, 2 in the merge
FLOAT32_BYTES = 4
KeyValues = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (a, b) -> K, V [b - a, kv_heads, d]


def tile_bytes_per_key(heads: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes one key of a tile holds: K and V gathered, and their GQA-expanded copies (module docstring)."""
    return 2 * (kv_heads + heads) * head_dim * elem_bytes


def tile_bytes_per_query(heads: int, head_dim: int) -> int:
    """Bytes one query of a tiled call holds, whatever the tile (float32 running output and merge)."""
    return TILE_QUERY_COPIES * heads * head_dim * FLOAT32_BYTES


def key_tile_tokens(
    workspace_bytes: int, num_queries: int, heads: int, kv_heads: int, head_dim: int, elem_bytes: int
) -> int:
    """The most keys per tile, a multiple of KEY_GRID (at least one grid), whose bytes and the queries' fixed
    bytes fit `workspace_bytes`."""
    left = workspace_bytes - num_queries * tile_bytes_per_query(heads, head_dim)
    keys = left // tile_bytes_per_key(heads, kv_heads, head_dim, elem_bytes)
    return max(KEY_GRID, keys // KEY_GRID * KEY_GRID)


def untiled_bytes(num_queries: int, num_keys: int, heads: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """What the untiled CPU paths hold for one chunk at their widest (the larger of the two): the context's
    K/V gathered, the flash path's GQA-expanded copies or the oneDNN path's padded K and V^T, and the oneDNN
    path's scores and probabilities of one query block ([group * 256, keys] float32 each)."""
    group = heads // kv_heads
    padded = -(-num_keys // KEY_GRID) * KEY_GRID
    gathered = 2 * num_keys * kv_heads * head_dim * elem_bytes
    flash = 2 * num_keys * heads * head_dim * elem_bytes
    blocks = min(num_queries, 256)
    onednn = (2 * kv_heads + 1) * padded * head_dim * FLOAT32_BYTES + 2 * group * blocks * padded * FLOAT32_BYTES
    return gathered + max(flash, onednn)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, L, d], k/v [1, H, S, d] -> (out [1, H, L, d], lse [1, H, L] float32)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def tiled_attention(q: torch.Tensor, key_values: KeyValues, start: int, scale: float, tile: int) -> torch.Tensor:
    """q [L, H, d] at positions [start, start + L) over keys [0, start + L), read `tile` at a time through
    `key_values`. Query i sees keys [0, start + i]. Returns [L, H, d] in q's dtype. GQA: head h reads KV
    head h // (H / kv_heads)."""
    length, heads, _ = q.shape
    qh = q.transpose(0, 1)[None]  # [1, H, L, d]
    acc = lse = None  # [H, L, d], [H, L] float32: the running result and its log-sum-exp

    def attend(k0: int, k1: int, row0: int) -> None:
        nonlocal acc, lse
        k, v = key_values(k0, k1)  # [n, kvh, d]
        group = heads // k.shape[1]
        kh = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]  # [1, H, n, d]
        vh = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
        out_t, lse_t = _flash(qh[:, :, row0:], kh, vh, row0 > 0 or k0 > start, scale)
        out_t, lse_t = out_t[0].float(), lse_t[0]
        if acc is None or lse is None:  # the shared keys' first tile covers every row
            acc, lse = out_t, lse_t.clone()
            return
        a, b = acc[:, row0:], lse[:, row0:]
        top = torch.maximum(b, lse_t)
        w_run, w_tile = torch.exp(b - top), torch.exp(lse_t - top)
        total = w_run + w_tile
        a.mul_((w_run / total)[..., None]).add_(out_t * (w_tile / total)[..., None])
        b.copy_(top + torch.log(total))

    shared = start + 1  # keys every query sees
    for k0 in range(0, shared, tile):
        attend(k0, min(shared, k0 + tile), 0)
    for k0 in range(shared, start + length, tile):  # queries at positions >= k0: rows [k0 - start, L)
        attend(k0, min(start + length, k0 + tile), k0 - start)
    assert acc is not None
    return acc.transpose(0, 1).to(q.dtype)


def slot_key_values(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor) -> KeyValues:
    """Tiles gathered from the flat cache slots of a context's positions (`PrefillSpan.kv_slots`)."""

    def gather(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = kv_slots[a:b]
        return k_cache.index_select(0, slots), v_cache.index_select(0, slots)

    return gather


def page_key_values(
    k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, page_size: int, first_slot: int | None
) -> KeyValues:
    """Tiles of one sequence's context: cache rows from `first_slot` on when its pages are consecutive (views),
    else the tile's pages gathered from its page table `pages` and cut to the tile."""

    def gather(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if first_slot is not None:
            return k_cache[first_slot + a : first_slot + b], v_cache[first_slot + a : first_slot + b]
        kvh, d = k_cache.shape[1], k_cache.shape[2]
        p0, p1 = a // page_size, -(-b // page_size)
        rows, skip = pages[p0:p1], a - p0 * page_size
        k = k_cache.view(-1, page_size * kvh * d).index_select(0, rows).view(-1, kvh, d)[skip : skip + b - a]
        v = v_cache.view(-1, page_size * kvh * d).index_select(0, rows).view(-1, kvh, d)[skip : skip + b - a]
        return k, v

    return gather
