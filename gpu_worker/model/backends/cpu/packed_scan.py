"""The packed SSD scan of every prefill span at once, laid out for CPU GEMMs (the model's prefill scan).

Same contract as `packed_prefill.packed_ssd_scan` (the einsum formulation, kept as the reference): x
[Tp, H, P], dt [Tp, H] (softplus'd, clamped), A [H], B/C [Tp, G, N], D [H], initial [S, H, P, N] ->
`PackedScan`. Layouts stay [chunk, token, head, channel], so the state parts are one GEMM per chunk
for all heads of a group, with no permuted copies. The states are kept transposed, [N, heads x P]
per group (so [c, g, N, k, P]), until they are returned: both GEMMs then read or write whole
contiguous rows (13-15% faster than [heads x P, N] for these shapes), and the carry between chunks
is elementwise in any layout:

    own end state    S_c^T = B^T @ (exp(a_last - a_cum) * dt * x)                [N, Q] @ [Q, heads x P]
    from start       y_l  += exp(a_cum_l) * (C @ S_start^T)_l                    [Q, N] @ [N, heads x P]

The within-chunk part y_l = sum_{s<=l} (C_l . B_s) exp(a_cum_l - a_cum_s) dt_s x_s takes one of two forms:

- factored (when every chunk's log-decay -a_last <= MAX_CHUNK_LOG_DECAY): with a reference r per chunk
  and head, exp(a_cum_l - a_cum_s) = exp(a_cum_l - r) exp(r - a_cum_s), so the masked C.B matrix is
  shared by every head of a group and one [Q x Q] @ [Q x (heads x P)] GEMM per chunk does them all.
  r = a_last / 2 keeps each factor within exp(+-60), normal float32 numbers; each term is scaled by
  positive factors (no differences of large numbers), so the result is as exact as the segment sums.
- blocked (when the chunk decays too much but every block of BLOCK_TOKENS tokens does not, e.g. random
  checkpoints with dt * |A| of a few per token): each diagonal [16 x 16] block is factored around its
  own midpoint (one batched GEMM for all heads of a group), and the rows of block i read the columns
  before it as exp(a_l - e_i) exp(e_i - a_s) with e_i the log-decay at block i's start, both factors
  <= 1 (one GEMM per block row). Exponents come from cumulative sums local to a block, so the weights
  are as exact as the segment sums. bench_prefill's random checkpoint (6 Mamba layers, SSD scan ms):
  32 prompts of 16..256 tokens 253 -> 234, 8 x 256 75 -> 62, 4 x 2,000 325 -> 289 against the decay
  matrices.
- decay matrices (otherwise: a single token that decays by dozens, blocks of 8 too): the per-head
  [Q x Q] matrices exp(segment sums), exact cumulative sums as in `ssd.ssd_scan`, then one batched
  [Q x Q] @ [Q x P] GEMM per head and chunk.

Every exponent is clamped at LOG_FLOOR (-60) first: exp() of values below float32's normal range
(about -87) runs ~14x slower on CPU (subnormal results), and a weight of e^-60 ~ 1e-26 instead of a
smaller one changes nothing float32 can represent next to the weight-1 terms of the same output.

Measured on one core (this project's CI machine, 8 heads of 64, d_state 64, Q = 64, CPU ms per layer):
4 x 2,000 tokens: einsum form 70.5, decay matrices 49.0; with trained-size decays einsum 61.2, factored
36.0. 1 x 3,000 tokens: 28.3 -> 18.0."""

from __future__ import annotations

from typing import Literal

import torch

from gpu_worker.model.backends.cpu.packed_prefill import PackedPrefillIndex, PackedScan, carry_states

# Largest total log-decay -sum(dt * A) of one scan chunk for the factored form: its factors reach
# exp(+-60) ~ 1e+-26, well inside float32's normal range (1e+-38), with room for the values they scale.
MAX_CHUNK_LOG_DECAY = 120.0
LOG_FLOOR = -60.0  # exponents are clamped here before exp() (see the module docstring)
ScanForm = Literal["auto", "factored", "blocked", "decay_matrices"]
BLOCK_TOKENS = (16, 8)  # block lengths of the blocked form, in the order tried (see the module docstring)


def packed_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    initial: torch.Tensor, index: PackedPrefillIndex, form: ScanForm = "auto",
) -> PackedScan:  # fmt: skip
    """The scan (module docstring). `form` "auto" picks the factored form when every chunk allows it;
    forcing "factored" on chunks that decay more than MAX_CHUNK_LOG_DECAY raises ValueError."""
    num_heads, head_dim = x.shape[1], x.shape[2]
    groups, state_size = B.shape[1], B.shape[2]
    per_group = num_heads // groups
    width = per_group * head_dim  # channels of one group: its heads x P
    q, n_chunks = index.chunk_size, index.num_chunks
    dt = dt.float()

    def to_scan(t: torch.Tensor) -> torch.Tensor:  # [Tp, ...] -> [N, Q, ...]; pad rows are zero
        out = t.new_empty((n_chunks * q, *t.shape[1:])).index_copy_(0, index.unscan_rows, t)
        return out.index_fill_(0, index.scan_pad_rows, 0.0).view(n_chunks, q, *t.shape[1:])

    def by_group(t: torch.Tensor, cols: int) -> torch.Tensor:  # [c, q, g * cols] -> [c * g, q, cols]
        return t.view(n_chunks, q, groups, cols).transpose(1, 2).reshape(n_chunks * groups, q, cols)

    def per_head(t: torch.Tensor) -> torch.Tensor:  # [c, h] -> [c, g, 1, k, p], against transposed states
        # repeated over p: a factor that changes every p values would cut the multiply-adds in 64-value runs
        return t.view(-1, groups, 1, per_group, 1).expand(-1, -1, -1, -1, head_dim).contiguous()

    a = to_scan(dt * A.float()[None, :])  # [c, q, h]: log-decay of each token
    a_cum = torch.cumsum(a, dim=1)  # non-increasing along q
    a_last = a_cum[:, -1]  # [c, h]
    fits = bool((a_last >= -MAX_CHUNK_LOG_DECAY).all())
    if form == "factored" and not fits:
        raise ValueError(f"a scan chunk decays by more than {MAX_CHUNK_LOG_DECAY} (log): no factored form")
    block = 0  # the blocked form's block length, once chosen
    if form == "blocked" or (form == "auto" and not fits):
        block = _fitting_block(a, form == "blocked")
        form = "blocked" if block else "decay_matrices"
    factored = fits if form == "auto" else form == "factored"
    xdt = to_scan(x.float()).mul_(to_scan(dt)[..., None])  # [c, q, h, p]
    Bg = by_group(to_scan(B.float()).view(n_chunks, q, -1), state_size)  # [c*g, q, n]
    Cg = by_group(to_scan(C.float()).view(n_chunks, q, -1), state_size)
    cb = torch.bmm(Cg, Bg.transpose(1, 2))  # [c*g, l, s]: C_l . B_s

    if factored:  # every factor relative to r = a_last / 2, so exp(a_last - r) = exp(r) = r_scale
        ref = a_last * 0.5
        r_scale = per_head(torch.exp(ref))  # [c, g, 1, k, 1]
        weighted = xdt.mul_(torch.exp(ref[:, None, :] - a_cum)[..., None])  # dt x w_in, in place
    else:
        weighted = xdt * torch.exp((a_last[:, None, :] - a_cum).clamp_(min=LOG_FLOOR))[..., None]
    xg = by_group(weighted.view(n_chunks, q, -1), width)  # [c*g, q, k*p]; views when g == 1

    # states transposed, [c, g, n, k, p]: both state GEMMs then read and write contiguous [n, k*p]
    own = torch.bmm(Bg.transpose(1, 2), xg).view(n_chunks, groups, state_size, per_group, head_dim)
    if factored:
        own.mul_(r_scale)
    initial_t = initial.float().view(-1, groups, per_group, head_dim, state_size).permute(0, 1, 4, 2, 3)
    decay = per_head(torch.exp(a_last.clamp(min=LOG_FLOOR)))
    starts, finals = carry_states(own, decay, initial_t.contiguous(), index)
    from_start = starts * r_scale if factored else starts
    from_start = from_start.view(n_chunks * groups, state_size, width)  # [c*g, n, k*p]

    if factored:
        y = torch.baddbmm(torch.bmm(cb.tril_(), xg), Cg, from_start)  # [c*g, q, k*p], still over w_out
        y = _groups_to_heads(y, n_chunks, groups, q, num_heads, head_dim)
        y.mul_(torch.exp(a_cum - ref[:, None, :])[..., None])  # w_out
    else:
        y = _groups_to_heads(torch.bmm(Cg, from_start), n_chunks, groups, q, num_heads, head_dim)
        y.mul_(torch.exp(a_cum.clamp(min=LOG_FLOOR))[..., None])
    if form == "blocked":
        y.add_(_within_blocked(a, xdt, cb, Cg, Bg, block))
    elif not factored:
        decay = _decay_matrices(a.permute(2, 0, 1))  # [h, c, l, s]
        decay.view(groups, -1, n_chunks, q, q).mul_(cb.view(n_chunks, groups, q, q).transpose(0, 1)[:, None])
        xdt_by_head = xdt.permute(2, 0, 1, 3).reshape(num_heads * n_chunks, q, head_dim)
        within = torch.bmm(decay.view(num_heads * n_chunks, q, q), xdt_by_head)  # [h*c, q, p]
        y.add_(within.view(num_heads, n_chunks, q, head_dim).permute(1, 2, 0, 3))
    y_rows = y.reshape(n_chunks * q, num_heads, head_dim).index_select(0, index.unscan_rows)
    out = y_rows.addcmul_(x.float(), D.float()[None, :, None])
    return PackedScan(y=out, chunk_start_states=_untransposed(starts), final_states=_untransposed(finals))


def _untransposed(states: torch.Tensor) -> torch.Tensor:
    """[m, g, n, k, p] -> [m, H, P, n] (a view when g == 1)."""
    m, groups, n, per_group, head_dim = states.shape
    return states.permute(0, 1, 3, 4, 2).reshape(m, groups * per_group, head_dim, n)


def _groups_to_heads(
    t: torch.Tensor, n_chunks: int, groups: int, q: int, num_heads: int, head_dim: int
) -> torch.Tensor:
    """[c*g, q, k*p] -> [c, q, h, p] (a view when g == 1)."""
    return t.view(n_chunks, groups, q, -1).transpose(1, 2).reshape(n_chunks, q, num_heads, head_dim)


def _decay_matrices(a: torch.Tensor) -> torch.Tensor:
    """a [..., Q] -> out[..., l, s] = exp(sum(a[..., s+1 : l+1])) for l >= s, 0 above the diagonal.

    Sums are masked cumulative sums (exact for long chunks, as ssd._segment_sum), clamped at LOG_FLOOR."""
    q = a.shape[-1]
    strict_lower = torch.ones(q, q, dtype=torch.bool, device=a.device).tril_(-1)
    sums = torch.cumsum(a[..., :, None].expand(*a.shape, q).masked_fill(~strict_lower, 0.0), dim=-2)
    return sums.clamp_(min=LOG_FLOOR).exp_().tril_()


def _fitting_block(a: torch.Tensor, required: bool) -> int:
    """The first of BLOCK_TOKENS (then the chunk length q itself) that divides q and whose every block
    of every chunk of a [c, q, h] decays by at most MAX_CHUNK_LOG_DECAY (log); 0 when none does
    (ValueError when `required`). Blocks of 16 serve most layers of a random checkpoint; a token that
    decays by dozens on its own needs shorter ones."""
    n_chunks, q, num_heads = a.shape
    for block in (*BLOCK_TOKENS, q):  # a block of the whole chunk is the factored form's
        if q % block == 0:
            decays = a.view(n_chunks, q // block, block, num_heads).sum(dim=2)
            if bool((decays >= -MAX_CHUNK_LOG_DECAY).all()):
                return block
    if required:
        raise ValueError(f"a scan block decays by more than {MAX_CHUNK_LOG_DECAY} (log): no blocked form")
    return 0


def _within_blocked(
    a: torch.Tensor, xdt: torch.Tensor, cb: torch.Tensor, Cg: torch.Tensor, Bg: torch.Tensor, block: int
) -> torch.Tensor:
    """The within-chunk term of the blocked form: a [c, q, h] (each token's log-decay), xdt [c, q, h, p],
    cb [c*g, q, q] (C_l . B_s, unmasked), Cg/Bg [c*g, q, n] -> [c, q, h, p].

    Rows and columns split in blocks of `block` tokens; every exponent is a sum of log-decays between
    its two tokens taken from cumulative sums local to a block (as exact as the segment sums). A
    diagonal block is factored around the midpoint m of its own log-decays, exp(a_l - a_s) =
    exp(a_l - m) exp(m - a_s), each factor within exp(+-60) when the block decays by at most
    MAX_CHUNK_LOG_DECAY; block i's rows read the earlier columns through its start e_i,
    exp(a_l - a_s) = exp(a_l - e_i) exp(e_i - a_s), both factors <= 1."""
    n_chunks, q, num_heads = a.shape
    head_dim = xdt.shape[-1]
    groups = Cg.shape[0] // n_chunks
    nb, width = q // block, num_heads // groups * head_dim
    local = a.view(n_chunks, nb, block, num_heads).cumsum(dim=2)  # log-decay from each block's start
    totals = local[:, :, -1:]  # [c, nb, 1, h]: each block's whole log-decay
    mid = totals * 0.5
    xs = xdt.view(n_chunks, nb, block, num_heads, head_dim) * torch.exp(mid - local)[..., None]

    def blocks_by_group(t: torch.Tensor, cols: int) -> torch.Tensor:  # [c, nb, b, g * cols] -> [c*nb*g, b, cols]
        return t.reshape(n_chunks, nb, block, groups, cols).transpose(2, 3).reshape(-1, block, cols)

    c_d = blocks_by_group(Cg.view(n_chunks, groups, q, -1).transpose(1, 2), Cg.shape[-1])
    b_d = blocks_by_group(Bg.view(n_chunks, groups, q, -1).transpose(1, 2), Bg.shape[-1])
    y = torch.bmm(torch.bmm(c_d, b_d.transpose(1, 2)).tril_(), blocks_by_group(xs, width))  # [c*nb*g, b, k*p]
    y = y.view(n_chunks, nb, groups, block, width).transpose(2, 3).reshape(n_chunks, q, num_heads, head_dim)
    y.view(n_chunks, nb, block, num_heads, head_dim).mul_(torch.exp(local - mid)[..., None])
    to_block_end = totals - local  # [c, nb, b, h]: log-decay from each token (excluded) to its block's end
    for i in range(1, nb):
        rows = slice(i * block, (i + 1) * block)
        # log-decay of the whole blocks between block j and block i: sum(totals[j+1 : i])
        between = torch.cat([totals[:, 1:i].flip(1).cumsum(1).flip(1), torch.zeros_like(totals[:, :1])], 1)
        to_edge = (to_block_end[:, :i] + between).clamp_(min=LOG_FLOOR).exp_()  # exp(e_i - a_s), s before block i
        before = xdt[:, : i * block] * to_edge.view(n_chunks, i * block, num_heads)[..., None]
        before_g = before.view(n_chunks, i * block, groups, width).transpose(1, 2).reshape(-1, i * block, width)
        part = torch.bmm(cb[:, rows, : i * block], before_g)  # [c*g, b, k*p]
        part = _groups_to_heads(part, n_chunks, groups, block, num_heads, head_dim)
        y[:, rows].addcmul_(part, torch.exp(local[:, i].clamp(min=LOG_FLOOR))[..., None])
    return y
