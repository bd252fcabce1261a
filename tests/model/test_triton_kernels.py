"""Every Triton kernel against its torch contract (`gpu_worker.model.backends.reference`), in float32 at 1e-4.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set before the
kernels are imported); with CUDA they run compiled on the GPU. Shapes are small and odd on purpose:
head dims and groups that are not powers of two, page tables with holes, padded rows (slot -1),
sequences shorter than the conv window, chunks longer than one program's block."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu_worker.model.backends import reference as ref  # noqa: E402
from gpu_worker.model.backends.cuda import attention as attn_k  # noqa: E402
from gpu_worker.model.backends.cuda import mamba as mamba_k  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-4


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    diff = (got.cpu().float() - want.float()).abs().max().item()
    assert diff <= tol, f"max abs diff {diff}"


def _scattered_pages(num_pages_total: int, counts: list[int], seed: int) -> list[list[int]]:
    """Disjoint, shuffled page ids per sequence, leaving unused pages (holes) between them."""
    perm = torch.randperm(num_pages_total, generator=torch.Generator().manual_seed(seed)).tolist()
    out, at = [], 0
    for n in counts:
        out.append(perm[at : at + n])
        at += n + 1  # skip one: a hole
    return out


def test_write_kv_skips_padded_rows() -> None:
    k, v = _rand(5, 3, 12, seed=0), _rand(5, 3, 12, seed=1)
    slots = torch.tensor([7, -1, 0, 12, -1])
    kc, vc = torch.zeros(16, 3, 12), torch.zeros(16, 3, 12)
    want_k, want_v = kc.clone(), vc.clone()
    ref.write_kv(k, v, want_k, want_v, slots)
    got_k, got_v = kc.to(DEVICE), vc.to(DEVICE)
    attn_k.write_kv(k.to(DEVICE), v.to(DEVICE), got_k, got_v, slots.to(DEVICE))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
    assert want_k[7].abs().sum() > 0  # the reference did write


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "page_size"), [(4, 2, 16, 4), (6, 2, 24, 3), (2, 2, 8, 16)])
def test_paged_decode_attention(heads: int, kv_heads: int, head_dim: int, page_size: int) -> None:
    seq_lens = [1, 0, 37, page_size, 70, 2 * page_size + 1]  # 0: a padded row
    counts = [-(-n // page_size) for n in seq_lens]
    max_pages = max(counts) + 2
    pages = _scattered_pages(sum(counts) + len(counts) + 3, counts, seed=heads)
    table = torch.tensor([p + [0] * (max_pages - len(p)) for p in pages], dtype=torch.int32)
    num_slots = (sum(counts) + len(counts) + 3) * page_size
    kc, vc = _rand(num_slots, kv_heads, head_dim, seed=2), _rand(num_slots, kv_heads, head_dim, seed=3)
    q = _rand(len(seq_lens), heads, head_dim, seed=4)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    want = ref.paged_decode_attention(q, kc, vc, table, lens, page_size, scale)
    got = attn_k.paged_decode_attention(
        q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), table.to(DEVICE), lens.to(DEVICE), page_size, scale
    )
    _close(got, want)
    assert got[1].abs().max().item() == 0.0  # padded row


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 24)])
def test_paged_prefill_attention_packed_ragged_chunks(heads: int, kv_heads: int, head_dim: int) -> None:
    """Three chunks packed back to back: fresh, continuing over 23 cached tokens, and one longer than a
    query block (so several programs split it and the causal edge falls inside a key block)."""
    page_size = 4
    spans = [(0, 5, 0), (5, 9, 23), (14, 70, 3)]  # (token_start, num_tokens, start_pos)
    counts = [-(-(start + n) // page_size) for _, n, start in spans]
    pages = _scattered_pages(sum(counts) + len(counts) + 2, counts, seed=7)
    num_slots = (sum(counts) + len(counts) + 2) * page_size
    slot_maps = [
        (torch.tensor(p)[:, None] * page_size + torch.arange(page_size)).reshape(-1)[: start + n]
        for p, (_, n, start) in zip(pages, spans, strict=True)
    ]
    kc, vc = _rand(num_slots, kv_heads, head_dim, seed=8), _rand(num_slots, kv_heads, head_dim, seed=9)
    q = _rand(84, heads, head_dim, seed=10)
    scale = head_dim**-0.5
    want = ref.paged_prefill_attention(q, kc, vc, spans, slot_maps, scale)
    offsets = torch.tensor([0, *torch.cumsum(torch.tensor([len(m) for m in slot_maps]), 0).tolist()[:-1]])
    meta = torch.tensor([[t0, n, start, int(off)] for (t0, n, start), off in zip(spans, offsets, strict=True)])
    got = attn_k.paged_prefill_attention(
        q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), meta.to(DEVICE), torch.cat(slot_maps).to(DEVICE), 70, scale
    )
    _close(got, want)


@pytest.mark.parametrize("kw", [2, 4])
def test_conv_update_shifts_the_window_and_skips_padded_rows(kw: int) -> None:
    conv_dim, rows = 150, 6  # more channels than one program's block
    state = _rand(rows, conv_dim, kw - 1, seed=11)
    x, w, bias = _rand(4, conv_dim, seed=12), _rand(conv_dim, kw, seed=13), _rand(conv_dim, seed=14)
    slots = torch.tensor([3, -1, 0, 5])
    want_state = state.clone()
    want = ref.conv_update(x, want_state, w, bias, slots)
    got_state = state.to(DEVICE)
    got = mamba_k.conv_update(x.to(DEVICE), got_state, w.to(DEVICE), bias.to(DEVICE), slots.to(DEVICE))
    _close(got, want)
    _close(got_state, want_state)
    assert torch.equal(got_state.cpu()[1], state[1])  # untouched row
    got_nb = mamba_k.conv_update(x.to(DEVICE), state.clone().to(DEVICE), w.to(DEVICE), None, slots.to(DEVICE))
    _close(got_nb, ref.conv_update(x, state.clone(), w, None, slots))


@pytest.mark.parametrize("kw", [2, 4])
def test_conv_varlen_continues_each_row_and_leaves_the_last_inputs(kw: int) -> None:
    """Chunks of 1 and 2 tokens (shorter than the window: the new row mixes old state and input), one of
    40 (longer than a token block), with non-zero initial rows."""
    conv_dim = 130
    lengths = [1, 40, 2, 7]
    starts = torch.cumsum(torch.tensor([0, *lengths]), 0).tolist()
    spans = [(starts[i], n, slot) for i, (n, slot) in enumerate(zip(lengths, [4, 0, 2, 1], strict=True))]
    state = _rand(5, conv_dim, kw - 1, seed=15)
    x, w, bias = _rand(sum(lengths), conv_dim, seed=16), _rand(conv_dim, kw, seed=17), _rand(conv_dim, seed=18)
    want_state = state.clone()
    want = ref.conv_varlen(x, want_state, w, bias, spans)
    got_state = state.to(DEVICE)
    got = mamba_k.conv_varlen(x.to(DEVICE), got_state, w.to(DEVICE), bias.to(DEVICE), torch.tensor(spans).to(DEVICE))
    _close(got, want)
    _close(got_state, want_state)
    assert torch.equal(got_state.cpu()[3], state[3])  # no span uses row 3


SSM_CASES = [(4, 2, 8, 16, True, True), (3, 1, 20, 12, True, False), (2, 2, 16, 8, False, False)]


@pytest.mark.parametrize(("heads", "groups", "head_dim", "state_size", "with_d", "with_z"), SSM_CASES)
def test_ssm_update(heads: int, groups: int, head_dim: int, state_size: int, with_d: bool, with_z: bool) -> None:
    b, rows = 4, 6
    state = _rand(rows, heads, head_dim, state_size, seed=19)
    x, z = _rand(b, heads, head_dim, seed=20), _rand(b, heads, head_dim, seed=21)
    dt = torch.rand(b, heads, generator=torch.Generator().manual_seed(22)) * 0.5
    A = -torch.rand(heads, generator=torch.Generator().manual_seed(23)) * 4
    B, C = _rand(b, groups, state_size, seed=24), _rand(b, groups, state_size, seed=25)
    D = _rand(heads, seed=26)
    slots = torch.tensor([2, -1, 5, 0])
    d, zz = (D if with_d else None), (z if with_z else None)
    want_state = state.clone()
    want = ref.ssm_update(want_state, x, dt, A, B, C, d, zz, slots)
    got_state = state.to(DEVICE)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, dt, A, B, C, d, zz, slots)]
    got = mamba_k.ssm_update(got_state, *dev)  # type: ignore[arg-type]
    _close(got, want)
    _close(got_state, want_state)
    assert torch.equal(got_state.cpu()[1], state[1])


def test_reference_ssm_update_matches_the_model_recurrence() -> None:
    """The oracle itself agrees with the model's own one-step update (`ssd.ssm_step_`)."""
    from gpu_worker.model.ssd import ssm_step_

    state = _rand(3, 4, 8, 16, seed=27)
    x, dt = _rand(3, 4, 8, seed=28), torch.rand(3, 4, generator=torch.Generator().manual_seed(29))
    A, D = -torch.rand(4, generator=torch.Generator().manual_seed(30)), _rand(4, seed=31)
    B, C = _rand(3, 2, 16, seed=32), _rand(3, 2, 16, seed=33)
    mine = state.clone()
    want = ref.ssm_update(mine, x, dt, A, B, C, D, None, torch.arange(3))
    model_state = state.clone()
    got = ssm_step_(model_state, x, dt, A, B, C, D)
    _close(got, want, 1e-5)
    _close(model_state, mine, 1e-5)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton's interpreter gets tl.dot wrong on bf16 inputs")
def test_bfloat16_attention_accumulates_in_float32() -> None:
    """The serving dtype: bf16 caches and queries, float32 scores and softmax."""
    bf16 = torch.bfloat16
    page_size, lens = 4, [9, 0, 33]
    table = torch.tensor([[5, 2, 7, 0, 0, 0, 0, 0, 0], [0] * 9, [1, 3, 4, 6, 8, 9, 10, 11, 12]], dtype=torch.int32)
    kc, vc = _rand(52, 2, 32, seed=40, dtype=bf16), _rand(52, 2, 32, seed=41, dtype=bf16)
    q = _rand(3, 4, 32, seed=42, dtype=bf16)
    want = ref.paged_decode_attention(q, kc, vc, table, torch.tensor(lens), page_size, 32**-0.5)
    got = attn_k.paged_decode_attention(
        q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), table.to(DEVICE), torch.tensor(lens).to(DEVICE), page_size, 32**-0.5
    )
    assert got.dtype == bf16
    _close(got, want, 1e-2 * want.abs().max().item())
    spans, slots = torch.tensor([[0, 5, 4, 0]]), torch.tensor([17, 18, 19, 40, 41, 42, 43, 44, 45])
    q = _rand(5, 4, 32, seed=46, dtype=bf16)
    want = ref.paged_prefill_attention(q, kc, vc, [(0, 5, 4)], [slots], 32**-0.5)
    got = attn_k.paged_prefill_attention(
        q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), spans.to(DEVICE), slots.to(DEVICE), 5, 32**-0.5
    )
    _close(got, want, 1e-2 * want.abs().max().item())


def test_bfloat16_conv_and_state_update() -> None:
    """bf16 activations and conv state, float32 SSM state and arithmetic."""
    bf16 = torch.bfloat16
    state, x, w = (
        _rand(3, 40, 3, seed=43, dtype=bf16),
        _rand(2, 40, seed=44, dtype=bf16),
        _rand(40, 4, seed=45, dtype=bf16),
    )
    want_state, got_state = state.clone(), state.to(DEVICE)
    want = ref.conv_update(x, want_state, w, None, torch.tensor([2, 0]))
    got = mamba_k.conv_update(x.to(DEVICE), got_state, w.to(DEVICE), None, torch.tensor([2, 0]).to(DEVICE))
    assert got.dtype == bf16
    _close(got, want, 1e-2 * want.abs().max().item())  # one bf16 rounding of the float32 sum
    _close(got_state, want_state, 0.0)  # shifted, not recomputed: exact
    ssm = _rand(3, 4, 8, 16, seed=47)
    xs, z = _rand(2, 4, 8, seed=48, dtype=bf16), _rand(2, 4, 8, seed=49, dtype=bf16)
    dt, A = torch.rand(2, 4, generator=torch.Generator().manual_seed(50)), -torch.ones(4)
    B, C, D = _rand(2, 1, 16, seed=51, dtype=bf16), _rand(2, 1, 16, seed=52, dtype=bf16), _rand(4, seed=53)
    want_ssm, got_ssm = ssm.clone(), ssm.to(DEVICE)
    want = ref.ssm_update(want_ssm, xs, dt, A, B, C, D, z, torch.tensor([1, 2]))
    dev = [t.to(DEVICE) for t in (xs, dt, A, B, C, D, z, torch.tensor([1, 2]))]
    got = mamba_k.ssm_update(got_ssm, *dev)
    _close(got, want, 1e-4)  # float32 arithmetic on the same bf16 inputs
    _close(got_ssm, want_ssm, 1e-4)
