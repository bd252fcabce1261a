"""Every prefill chunk of a step through one causal conv and one SSD scan (varlen packing).

The per-sequence path (`Mamba2Mixer._prefill` + `ssd.ssd_scan`) runs ~30 small ops per chunk per layer;
with 32 short prompts in a step that Python and dispatch cost dominates on CPU. Here the chunks of all
sequences are laid side by side and every op runs once per layer. The per-sequence path stays as the
oracle (tests/model/test_packed_prefill.py compares the two).

Layouts (S sequences, sequence s has L_s tokens, Q = scan chunk length, K = conv width):
    prefill rows  [Tp]           the packed tokens of every span, in span order (contiguous in the batch)
    conv heads    [S, 2(K-1)]    per sequence: its K-1 state rows, then its first K-1 tokens (the rows
                                 whose conv reads the state; every other row reads the rows before it)
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
    conv_head_rows: torch.Tensor  # [S * (K-1)] int64: prefill row of each span's first K-1 tokens (clamped to its last)
    conv_fix_rows: torch.Tensor  # [F] int64: prefill rows that read a conv state (each span's first min(L_s, K-1))
    conv_fix_src: torch.Tensor  # [F] int64: their row in the heads' outputs [S * (K-1)]
    conv_tail_rows: torch.Tensor  # [S * (K-1)] int64: prefill row of each span's last K-1 tokens (clamped to its first)
    conv_keep_src: torch.Tensor  # [S * (K-1)] int64: new conv state rows in cat([heads' windows S*2(K-1), tails])
    scan_rows: torch.Tensor  # [N * Q] int64 into prefill rows, Tp = the zero pad row
    unscan_rows: torch.Tensor  # [Tp] int64: scan row of each prefill row
    scan_pad_rows: torch.Tensor  # [N * Q - Tp] int64: the scan rows that hold no token (zero in every input)
    chunk_start: tuple[int, ...]  # [S] first scan chunk of each sequence
    chunk_count: tuple[int, ...]  # [S] scan chunks of each sequence (c_s)
    num_chunks: int  # N
    chunk_size: int  # Q


def build_packed_index(
    spans: tuple[PrefillSpan, ...], chunk_size: int, conv_keep: int, device: torch.device
) -> PackedPrefillIndex:
    """The index maps of `spans` (see module docstring); pure integer bookkeeping on the host."""
    head_rows: list[int] = []
    fix_rows: list[int] = []
    fix_src: list[int] = []
    tail_rows: list[int] = []
    keep_src: list[int] = []
    scan_rows: list[int] = []
    pad_rows: list[int] = []
    unscan: list[int] = []
    chunk_start: list[int] = []
    chunk_count: list[int] = []
    num_windows = len(spans) * 2 * conv_keep  # rows of the heads' windows [S, 2(K-1)]: state, then head
    row = 0  # prefill row of the current span's first token
    num_chunks = 0
    total = sum(s.num_tokens for s in spans)
    for i, span in enumerate(spans):
        n = span.num_tokens
        head_rows.extend(row + min(j, n - 1) for j in range(conv_keep))
        fix_rows.extend(range(row, row + min(n, conv_keep)))
        fix_src.extend(range(i * conv_keep, i * conv_keep + min(n, conv_keep)))
        tail_rows.extend(row + max(n - conv_keep + j, 0) for j in range(conv_keep))
        # the last K-1 of [state, tokens]: window rows n.. when the span is shorter than K-1, else its tail
        keep_src.extend(i * 2 * conv_keep + n + j if n < conv_keep else num_windows + i * conv_keep + j
                        for j in range(conv_keep))  # fmt: skip
        c = -(-n // chunk_size)
        base = num_chunks * chunk_size
        unscan.extend(range(base, base + n))
        pad_rows.extend(range(base + n, base + c * chunk_size))
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
        conv_head_rows=tensor(head_rows), conv_fix_rows=tensor(fix_rows), conv_fix_src=tensor(fix_src),
        conv_tail_rows=tensor(tail_rows), conv_keep_src=tensor(keep_src),
        scan_rows=tensor(scan_rows), unscan_rows=tensor(unscan), scan_pad_rows=tensor(pad_rows),
        chunk_start=tuple(chunk_start), chunk_count=tuple(chunk_count), num_chunks=num_chunks, chunk_size=chunk_size,
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
    Returns the conv output [Tp, conv_dim] (before the activation), in the prefill rows' order.

    K shifted multiply-adds run over the packed rows themselves, each row reading the K-1 rows before
    it in the batch; only the first K-1 rows of each span read its conv state instead, and those are
    computed again from small [state, first K-1 tokens] windows and written over: no window copy of
    the batch, no gather of the output. The taps are made contiguous: a tap row read with stride K
    kept every multiply-add on the scalar loop (3.2x the time). Bias first, then taps in order: the
    same sums as `F.conv1d`, bit for bit."""
    num_rows, conv_dim = xbc.shape
    keep = conv_state.shape[-1]  # K - 1
    # the mixer's xbc is a column slice of in_proj's output: one copy to contiguous rows, then the
    # K passes run on whole rows (32 prompts of 16..256, 6 layers: 29 -> 22 ms)
    x = xbc.to(conv_state.dtype).contiguous()
    taps = weight[:, 0, :].t().to(x.dtype).contiguous()  # [K, C]; a strided row would not vectorize
    states = conv_state.index_select(0, index.state_slots).transpose(1, 2)  # [S, K-1, C]
    heads = torch.cat([states, x.index_select(0, index.conv_head_rows).view(-1, keep, conv_dim)], dim=1)

    def start(shape: tuple[int, int] | tuple[int, int, int]) -> torch.Tensor:
        return x.new_zeros(shape) if bias is None else bias.to(x.dtype).expand(shape).clone()

    out = start((num_rows, conv_dim))
    fixed = start((index.num_seqs, keep, conv_dim))  # outputs of each span's first K-1 tokens
    for j in range(keep + 1):  # tap j reads the input K-1-j rows back
        shift = keep - j
        if shift < num_rows:
            out[shift:].addcmul_(x[: num_rows - shift], taps[j])
        fixed.addcmul_(heads[:, j : j + keep], taps[j])
    out.index_copy_(0, index.conv_fix_rows, fixed.view(-1, conv_dim).index_select(0, index.conv_fix_src))
    pool = torch.cat([heads.reshape(-1, conv_dim), x.index_select(0, index.conv_tail_rows)])
    new_state = pool.index_select(0, index.conv_keep_src).view(index.num_seqs, keep, conv_dim)
    conv_state.index_copy_(0, index.state_slots, new_state.transpose(1, 2))
    return out


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
    S_start[first chunk of s] = initial[s]. chunk_states [N, ...] (any layout of the states, e.g.
    [N, H, P, n]), chunk_decay [N, ...] broadcastable to it (e.g. [N, H, 1, 1]), initial [S, ...].
    Returns (state before each chunk [N, ...], final state per sequence [S, ...]).

    When every sequence has as many chunks, one step per chunk position k, batched over the sequences
    on strided views (no gathers); otherwise one fused multiply-add per chunk, in place on views of
    the sequence-major chunks: 2.2x less time than gathering the chunks of each position for 32
    prompts of 16..256 tokens (a gather, a multiply-add and a scatter of [S, H, P, n] per step)."""
    counts = index.chunk_count
    decay = chunk_decay
    if max(counts) == 1:  # one chunk per sequence (short prompts): no gathers at all
        return initial, torch.addcmul(chunk_states, decay, initial)
    starts = torch.empty_like(chunk_states)
    if min(counts) == max(counts):
        shape = (index.num_seqs, counts[0], *chunk_states.shape[1:])
        by_seq, own, dec = starts.view(shape), chunk_states.view(shape), decay.view(*shape[:2], *decay.shape[1:])
        by_seq[:, 0] = initial
        for k in range(1, counts[0]):
            torch.addcmul(own[:, k - 1], dec[:, k - 1], by_seq[:, k - 1], out=by_seq[:, k])
        return starts, torch.addcmul(own[:, -1], dec[:, -1], by_seq[:, -1])
    finals = torch.empty_like(initial)
    for s, (first, count) in enumerate(zip(index.chunk_start, counts, strict=True)):
        starts[first] = initial[s]
        for k in range(first + 1, first + count):
            torch.addcmul(chunk_states[k - 1], decay[k - 1], starts[k - 1], out=starts[k])
        last = first + count - 1
        torch.addcmul(chunk_states[last], decay[last], starts[last], out=finals[s])
    return starts, finals


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
    chunk_decay = torch.exp(a_cum[:, :, -1]).t()[:, :, None, None]  # [c, h, 1, 1]

    starts, finals = carry_states(chunk_states, chunk_decay, initial.float(), index)
    from_start = torch.einsum("clgn,cgkpn->clgkp", C, starts.view(n_chunks, groups, per_group, head_dim, -1))
    y = y + from_start.reshape(n_chunks, q, num_heads, head_dim) * torch.exp(a_cum).permute(1, 2, 0)[..., None]
    y = y.reshape(n_chunks * q, num_heads, head_dim).index_select(0, index.unscan_rows)
    return PackedScan(y=y + x * D.float()[None, :, None], chunk_start_states=starts, final_states=finals)
