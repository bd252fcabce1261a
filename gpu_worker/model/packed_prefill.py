"""Every prefill chunk of a step through one causal conv and one SSD scan (varlen packing).

The per-sequence path (`Mamba2Mixer._prefill` + `ssd.ssd_scan`) runs ~30 small ops per chunk per layer;
with 32 short prompts in a step that Python and dispatch cost dominates on CPU. Here the chunks of all
sequences are laid side by side and every op runs once per layer. The per-sequence path stays as the
oracle (tests/model/test_packed_prefill.py compares the two).

Layouts (S sequences, sequence s has L_s tokens, Q = scan chunk length, K = conv width):
    prefill rows  [Tp]           the packed tokens of every span, in span order (contiguous in the batch)
    conv edge     [S*(K-1) + E]  each sequence's K-1 state rows, then the first and the last min(K-1, L_s)
                                 prefill rows of each sequence (the rows whose conv windows cross a state)
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

# Rows of the causal conv computed together: its K passes over a block stay in a core's cache
# (512 rows x 640 channels: 1.3 MB in, 1.3 MB out; 128 and 256 measured no faster).
CONV_ROW_BLOCK = 512


@dataclass(frozen=True, slots=True)
class PackedPrefillIndex:
    """Index maps shared by every Mamba layer of one forward (built once per forward)."""

    num_seqs: int
    num_prefill_tokens: int  # Tp
    state_slots: torch.Tensor  # [S] int64: state pool rows, in span order
    conv_edge_rows: torch.Tensor  # [E] int64: prefill rows gathered after the state rows into the conv edge
    conv_head_window: torch.Tensor  # [S * 2(K-1)] int64 into the edge: state rows, then the first K-1 tokens
    conv_head_rows: torch.Tensor  # [sum(min(K-1, L_s))] int64: prefill rows whose window crosses the state
    conv_head_pick: torch.Tensor  # same length, int64 into the head outputs [S * (K-1)]
    conv_keep_rows: torch.Tensor  # [S * (K-1)] int64 into the edge: rows that become each conv state
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
    edge_rows: list[int] = []
    head_window: list[int] = []
    head_rows: list[int] = []
    head_pick: list[int] = []
    keep_rows: list[int] = []
    scan_rows: list[int] = []
    unscan: list[int] = []
    chunk_start: list[int] = []
    chunk_count: list[int] = []
    num_states = len(spans) * conv_keep
    row = 0  # prefill row of the current span's first token
    num_chunks = 0
    total = sum(s.num_tokens for s in spans)
    for i, span in enumerate(spans):
        n = span.num_tokens
        m = min(conv_keep, n)
        head_at = num_states + len(edge_rows)  # edge position of the span's first token
        edge_rows.extend(range(row, row + m))
        tail_at = num_states + len(edge_rows) - (n - m)  # edge position of token t >= n - m: tail_at + t
        edge_rows.extend(range(row + n - m, row + n))
        # window [state (K-1), tokens 0..K-2]; tokens past the span read the edge's first row (unused outputs)
        head_window.extend(range(i * conv_keep, (i + 1) * conv_keep))
        head_window.extend(head_at + t if t < n else 0 for t in range(conv_keep))
        head_rows.extend(range(row, row + m))
        head_pick.extend(range(i * conv_keep, i * conv_keep + m))
        for w in range(n, n + conv_keep):  # window positions [n, n + K-1) of [state, tokens] become the state
            keep_rows.append(i * conv_keep + w if w < conv_keep else tail_at + w - conv_keep)
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
        conv_edge_rows=tensor(edge_rows), conv_head_window=tensor(head_window), conv_head_rows=tensor(head_rows),
        conv_head_pick=tensor(head_pick), conv_keep_rows=tensor(keep_rows),
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
    Returns the conv output [Tp, conv_dim] (before the activation). It runs as K shifted multiply-adds
    over the rows (tokens) of the whole batch, as if it were one sequence; the first K-1 rows of each
    span, whose windows reach into the span's conv state, are computed again from a small window of
    state and token rows (`conv_head_window`) and replace them. No copy of the batch's rows is made
    (the state rows are never laid in front of the tokens), and the passes run CONV_ROW_BLOCK rows at
    a time. Bias first, then the taps in order: the same sums as `F.conv1d`, bit for bit."""
    conv_dim = xbc.shape[1]
    keep = conv_state.shape[-1]
    x = xbc.to(conv_state.dtype)
    states = conv_state.index_select(0, index.state_slots).transpose(1, 2).reshape(-1, conv_dim)  # [S*(K-1), C]
    edge = torch.cat([states, x.index_select(0, index.conv_edge_rows)])
    new_state = edge.index_select(0, index.conv_keep_rows).view(index.num_seqs, keep, conv_dim)
    conv_state.index_copy_(0, index.state_slots, new_state.transpose(1, 2))
    taps = weight[:, 0, :].t()  # [K, C]
    num_rows = x.shape[0]
    out = x.new_empty(num_rows, conv_dim)
    for first in range(keep, num_rows, CONV_ROW_BLOCK):  # row t reads rows [t - K + 1, t]
        count = min(CONV_ROW_BLOCK, num_rows - first)  # rows before K-1 are heads, redone below
        _shifted_taps(x[first - keep : first + count], taps, bias, out[first : first + count], count)
    window = edge.index_select(0, index.conv_head_window).view(index.num_seqs, 2 * keep, conv_dim)
    heads = window.new_empty(index.num_seqs, keep, conv_dim)
    _shifted_taps(window, taps, bias, heads, keep, dim=1)
    out.index_copy_(0, index.conv_head_rows, heads.view(-1, conv_dim).index_select(0, index.conv_head_pick))
    return out


def _shifted_taps(
    x: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, num_out: int, dim: int = 0
) -> None:
    """out[t] = bias + sum_j taps[j] * x[t + j] along `dim` for t < num_out, summed in that order."""
    first = x.narrow(dim, 0, num_out)
    if bias is None:
        torch.mul(first, taps[0], out=out)
    else:
        torch.addcmul(bias, first, taps[0], out=out)
    for j in range(1, taps.shape[0]):
        out.addcmul_(x.narrow(dim, j, num_out), taps[j])


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
