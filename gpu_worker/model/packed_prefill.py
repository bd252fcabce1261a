"""Every prefill chunk of a step through one causal conv and one SSD scan (varlen packing).

The per-sequence path (`Mamba2Mixer._prefill` + `ssd.ssd_scan`) runs ~30 small ops per chunk per layer;
with 32 short prompts in a step that Python and dispatch cost dominates on CPU. Here the chunks of all
sequences are laid side by side and every op runs once per layer. The per-sequence path stays as the
oracle (tests/model/test_packed_prefill.py compares the two).

Layouts (S sequences, sequence s has L_s tokens, Q = scan chunk length, K = conv width):
    prefill rows  [Tp]           the packed tokens of every span, in span order (contiguous in the batch)
    conv windows  [sum(K-1+L_s)] per sequence: its K-1 state columns, then its L_s tokens
    scan rows     [N * Q]        per sequence: its tokens padded to whole scan chunks (pad rows: dt = 0)
    scan chunks   [N]            sequence-major: chunks [chunk_start[s], chunk_start[s] + c_s) are s's

States are reset at sequence starts because each chunk belongs to one sequence and the carry across
chunks (`carry_states`) runs per sequence from that sequence's own initial state. The scan returns the
state at the start of every scan chunk (`PackedScan.chunk_start_states`), so the state at any chunk
boundary inside a sequence's prefill is available without another pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.model.context import ForwardContext, PrefillSpan


@dataclass(frozen=True, slots=True)
class PackedPrefillIndex:
    """Index maps shared by every Mamba layer of one forward (built once per forward)."""

    num_seqs: int
    num_prefill_tokens: int  # Tp
    state_slots: torch.Tensor  # [S] int64: state pool rows, in span order
    conv_window_rows: torch.Tensor  # [sum(K-1+L_s)] int64 into cat([state rows S*(K-1), prefill rows Tp])
    conv_out_cols: torch.Tensor  # [Tp] int64: conv output column of each prefill row
    conv_keep_rows: torch.Tensor  # [S * (K-1)] int64: window rows that become each sequence's conv state
    scan_rows: torch.Tensor  # [N * Q] int64 into prefill rows, Tp = the zero pad row
    unscan_rows: torch.Tensor  # [Tp] int64: scan row of each prefill row
    chunk_start: tuple[int, ...]  # [S] first scan chunk of each sequence
    chunk_count: tuple[int, ...]  # [S] scan chunks of each sequence (c_s)
    num_chunks: int  # N
    chunk_size: int  # Q


def build_packed_index(
    spans: tuple[PrefillSpan, ...], chunk_size: int, conv_keep: int, device: torch.device
) -> PackedPrefillIndex:
    """The index maps of `spans` (see module docstring); pure integer bookkeeping on the host."""
    window_rows: list[int] = []
    out_cols: list[int] = []
    keep_rows: list[int] = []
    scan_rows: list[int] = []
    unscan: list[int] = []
    chunk_start: list[int] = []
    chunk_count: list[int] = []
    num_states = len(spans) * conv_keep
    row = 0  # prefill row of the current span's first token
    window_at = 0  # window offset of the current span
    num_chunks = 0
    total = sum(s.num_tokens for s in spans)
    for i, span in enumerate(spans):
        n = span.num_tokens
        window_rows.extend(range(i * conv_keep, (i + 1) * conv_keep))
        window_rows.extend(range(num_states + row, num_states + row + n))
        out_cols.extend(range(window_at, window_at + n))  # output j reads window [j, j + K)
        keep_rows.extend(range(window_at + n, window_at + n + conv_keep))
        window_at += n + conv_keep
        c = -(-n // chunk_size)
        base = num_chunks * chunk_size
        unscan.extend(range(base, base + n))
        scan_rows.extend(range(row, row + n))
        scan_rows.extend([total] * (c * chunk_size - n))
        chunk_start.append(num_chunks)
        chunk_count.append(c)
        num_chunks += c
        row += n

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device)

    return PackedPrefillIndex(
        num_seqs=len(spans), num_prefill_tokens=total, state_slots=tensor([s.state_slot for s in spans]),
        conv_window_rows=tensor(window_rows), conv_out_cols=tensor(out_cols), conv_keep_rows=tensor(keep_rows),
        scan_rows=tensor(scan_rows), unscan_rows=tensor(unscan), chunk_start=tuple(chunk_start),
        chunk_count=tuple(chunk_count), num_chunks=num_chunks, chunk_size=chunk_size,
    )  # fmt: skip


def packed_index_for(ctx: ForwardContext, chunk_size: int, conv_keep: int, device: torch.device) -> PackedPrefillIndex:
    """The forward's index maps for this scan geometry, built by the first Mamba layer and reused."""
    key = ("packed_prefill", chunk_size, conv_keep)
    found = ctx.derived.get(key)
    if isinstance(found, PackedPrefillIndex):
        return found
    index = build_packed_index(ctx.prefills, chunk_size, conv_keep, device)
    ctx.derived[key] = index
    return index


def packed_causal_conv(
    xbc: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    index: PackedPrefillIndex,
) -> torch.Tensor:  # fmt: skip
    """Causal depthwise conv of every span, each continuing from its conv state row; updates the rows.

    xbc [Tp, conv_dim] (pre-conv), weight [conv_dim, 1, K], conv_state [rows, conv_dim, K-1].
    Returns the conv output [Tp, conv_dim] (before the activation). One conv runs over all windows
    laid end to end; the K-1 outputs that straddle two windows are never read. It runs as K shifted
    multiply-adds over the rows (tokens) rather than `F.conv1d` on the transposed layout, which copies
    the windows to channel-major and back: 2.4x less time for 8,000 tokens of 640 channels on one core."""
    conv_dim = xbc.shape[1]
    keep = conv_state.shape[-1]
    states = conv_state.index_select(0, index.state_slots).transpose(1, 2).reshape(-1, conv_dim)  # [S*(K-1), C]
    windows = torch.cat([states, xbc.to(states.dtype)], dim=0).index_select(0, index.conv_window_rows)
    new_state = windows.index_select(0, index.conv_keep_rows).view(index.num_seqs, keep, conv_dim)
    conv_state.index_copy_(0, index.state_slots, new_state.transpose(1, 2))
    num_out = windows.shape[0] - keep  # output row t reads window rows [t, t + K)
    taps = weight[:, 0, :].t()  # [K, C]
    out = windows.new_zeros(num_out, conv_dim) if bias is None else bias.expand(num_out, conv_dim).clone()
    for j in range(keep + 1):  # bias first, then taps in order: the same sums as F.conv1d, bit for bit
        out.addcmul_(windows[j : j + num_out], taps[j])
    return out.index_select(0, index.conv_out_cols)


@dataclass(frozen=True, slots=True)
class PackedScan:
    y: torch.Tensor  # [Tp, H, P] float32, including the D skip
    chunk_start_states: torch.Tensor  # [N, H, P, N_state] float32: state before each scan chunk
    final_states: torch.Tensor  # [S, H, P, N_state] float32: each sequence's state after its span


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = sum(a[..., j+1 : i+1]) for i >= j, -inf above the diagonal (as ssd._segment_sum)."""
    q = a.shape[-1]
    x = a[..., :, None].expand(*a.shape, q)
    strict_lower = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~strict_lower, 0.0), dim=-2)
    lower = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=0)
    return sums.masked_fill(~lower, float("-inf"))


def carry_states(
    chunk_states: torch.Tensor, chunk_decay: torch.Tensor, initial: torch.Tensor, index: PackedPrefillIndex
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inter-chunk recurrence, per sequence: S_start[k+1] = decay[k] * S_start[k] + chunk_state[k],
    S_start[first chunk of s] = initial[s]. chunk_states [N, H, P, n], chunk_decay [N, H], initial
    [S, H, P, n]. Returns (state before each chunk [N, H, P, n], final state per sequence [S, H, P, n]).

    One step per chunk position k (at most the longest span's chunk count), each batched over the
    sequences that have a k-th chunk: strided views when every sequence has as many chunks (no
    gathers), else the chunks gathered by index."""
    counts = index.chunk_count
    decay = chunk_decay[:, :, None, None]
    if max(counts) == 1:  # one chunk per sequence (short prompts): no gathers at all
        return initial, torch.addcmul(chunk_states, decay, initial)
    starts = torch.empty_like(chunk_states)
    if min(counts) == max(counts):
        shape = (index.num_seqs, counts[0], *chunk_states.shape[1:])
        by_seq, own, dec = starts.view(shape), chunk_states.view(shape), decay.view(*shape[:2], -1, 1, 1)
        by_seq[:, 0] = initial
        for k in range(1, counts[0]):
            torch.addcmul(own[:, k - 1], dec[:, k - 1], by_seq[:, k - 1], out=by_seq[:, k])
        return starts, torch.addcmul(own[:, -1], dec[:, -1], by_seq[:, -1])
    device = chunk_states.device

    def rows(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    starts.index_copy_(0, rows(list(index.chunk_start)), initial)
    for k in range(1, max(counts)):
        before = rows([index.chunk_start[s] + k - 1 for s, c in enumerate(counts) if c > k])  # chunk k-1
        state = torch.addcmul(chunk_states.index_select(0, before), decay.index_select(0, before),
                              starts.index_select(0, before))  # fmt: skip
        starts.index_copy_(0, before + 1, state)
    last = rows([first + c - 1 for first, c in zip(index.chunk_start, counts, strict=True)])
    final = torch.addcmul(chunk_states.index_select(0, last), decay.index_select(0, last), starts.index_select(0, last))
    return starts, final


def packed_ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    initial: torch.Tensor, index: PackedPrefillIndex,
) -> PackedScan:  # fmt: skip
    """The chunked SSD scan (as `ssd.ssd_scan`) of every span at once.

    x [Tp, H, P], dt [Tp, H] (softplus'd, clamped), A [H], B/C [Tp, G, N], D [H], initial [S, H, P, N]
    float32 (each sequence's state before its span)."""
    num_heads, head_dim = x.shape[1], x.shape[2]
    groups = B.shape[1]
    per_group = num_heads // groups  # head h = g * per_group + k reads B/C group g
    q, n_chunks = index.chunk_size, index.num_chunks
    x, dt = x.float(), dt.float()

    def to_scan(t: torch.Tensor) -> torch.Tensor:  # [Tp, ...] -> [N, Q, ...] with zero pad rows
        padded = torch.cat([t, t.new_zeros((1, *t.shape[1:]))], dim=0).index_select(0, index.scan_rows)
        return padded.view(n_chunks, q, *t.shape[1:])

    xdt = to_scan(x * dt[..., None])  # [c, q, h, p]
    a = to_scan(dt * A.float()[None, :]).permute(2, 0, 1)  # [h, c, q]
    B, C = to_scan(B.float()), to_scan(C.float())  # [c, q, g, n]: per group, never repeated per head
    a_cum = torch.cumsum(a, dim=-1)  # [h, c, q]
    xdt_g = xdt.view(n_chunks, q, groups, per_group, head_dim)  # [c, q, g, k, p]

    # within-chunk outputs (as ssd.ssd_scan step 1): C.B once per group, the decay per head
    cb = torch.einsum("clgn,csgn->gcls", C, B)  # [g, c, l, s]
    scores = torch.exp(_segment_sum(a)).view(groups, per_group, n_chunks, q, q) * cb[:, None]
    y = torch.einsum("gkcls,csgkp->clgkp", scores, xdt_g).reshape(n_chunks, q, num_heads, head_dim)
    # each chunk's own end state from zero (step 2)
    to_end = torch.exp(a_cum[:, :, -1:] - a_cum).permute(1, 2, 0)[..., None]  # [c, s, h, 1]
    weighted = (xdt * to_end).view(n_chunks, q, groups, per_group, head_dim)
    chunk_states = torch.einsum("csgn,csgkp->cgkpn", B, weighted).reshape(n_chunks, num_heads, head_dim, -1)
    chunk_decay = torch.exp(a_cum[:, :, -1]).t()  # [c, h]

    starts, finals = carry_states(chunk_states, chunk_decay, initial.float(), index)
    from_start = torch.einsum("clgn,cgkpn->clgkp", C, starts.view(n_chunks, groups, per_group, head_dim, -1))
    y = y + from_start.reshape(n_chunks, q, num_heads, head_dim) * torch.exp(a_cum).permute(1, 2, 0)[..., None]
    y = y.reshape(n_chunks * q, num_heads, head_dim).index_select(0, index.unscan_rows)
    return PackedScan(y=y + x * D.float()[None, :, None], chunk_start_states=starts, final_states=finals)
