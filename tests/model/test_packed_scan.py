"""The model's packed SSD scan (gpu_worker.model.packed_scan), in each of its forms, against the per-sequence
scan (`ssd.ssd_scan`) and the einsum packed scan: outputs, final states and the state at every
scan-chunk boundary; chunks that decay beyond the factored form's range take the blocked form, and
blocks that decay beyond it the decay-matrix form, and stay exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.model.context import PrefillSpan
from gpu_worker.model.packed_prefill import PackedScan, build_packed_index, packed_ssd_scan
from gpu_worker.model.packed_scan import MAX_CHUNK_LOG_DECAY, packed_scan
from gpu_worker.model.ssd import ssd_scan

REL_TOL = 2e-6  # float32 rounding of another summation order, relative to the largest value


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= REL_TOL * scale


def _inputs(lengths: list[int], heads: int, groups: int, dt_scale: float, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    total, p, n = sum(lengths), 6, 5
    x = torch.randn(total, heads, p, generator=g)
    dt = torch.rand(total, heads, generator=g) * dt_scale
    A = -(torch.rand(heads, generator=g) * 8 + 0.5)
    B, C = torch.randn(total, groups, n, generator=g), torch.randn(total, groups, n, generator=g)
    D = torch.randn(heads, generator=g)
    initial = torch.randn(len(lengths), heads, p, n, generator=g)
    return x, dt, A, B, C, D, initial


def _check_against_one_scan_per_sequence(
    scan: PackedScan, lengths: list[int], inputs: tuple[torch.Tensor, ...], chunk: int, starts: tuple[int, ...]
) -> None:
    x, dt, A, B, C, D, initial = inputs
    at = 0
    for s, length in enumerate(lengths):
        rows = slice(at, at + length)
        chunk_states: list[torch.Tensor] = []
        y_ref, final_ref = ssd_scan(x[rows], dt[rows], A, B[rows], C[rows], D, initial[s], chunk, chunk_states)
        _close(scan.y[rows], y_ref)
        _close(scan.final_states[s], final_ref)
        count = -(-length // chunk)
        _close(scan.chunk_start_states[starts[s] : starts[s] + count], chunk_states[0][:count])
        at += length


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 70), min_size=1, max_size=5),
    geometry=st.sampled_from([(4, 1, 8), (4, 2, 16), (6, 3, 4), (2, 1, 64), (1, 1, 8)]),  # heads, groups, chunk
    form=st.sampled_from(["factored", "blocked", "decay_matrices"]),
    seed=st.integers(0, 1000),
)
def test_every_form_matches_one_scan_per_sequence(lengths, geometry, form, seed) -> None:
    heads, groups, chunk = geometry
    spans, at = [], 0
    for i, length in enumerate(lengths):
        spans.append(PrefillSpan(at, length, 1, i, torch.zeros(0, dtype=torch.int64)))
        at += length
    index = build_packed_index(tuple(spans), chunk, 3, torch.device("cpu"))
    # dt * |A| <= 0.1 * 8.5 per token: at most 55 per 64-token chunk, inside the factored range
    inputs = _inputs(lengths, heads, groups, 0.1, seed)
    scan = packed_scan(*inputs, index, form=form)
    _check_against_one_scan_per_sequence(scan, lengths, inputs, chunk, index.chunk_start)
    einsum_form = packed_ssd_scan(*inputs, index)
    _close(scan.y, einsum_form.y)
    _close(scan.chunk_start_states, einsum_form.chunk_start_states)


def test_chunks_that_decay_too_much_take_the_decay_matrix_form() -> None:
    """A chunk whose log-decay passes MAX_CHUNK_LOG_DECAY would overflow the factored form's scale
    factors; the scan then uses per-head decay matrices, with the same result as one scan per sequence
    (decays below e^-60 clamped there change nothing float32 shows)."""
    lengths, chunk = [40, 17], 16
    spans = (PrefillSpan(0, 40, 0, 0, torch.zeros(0, dtype=torch.int64)),
             PrefillSpan(40, 17, 0, 1, torch.zeros(0, dtype=torch.int64)))  # fmt: skip
    index = build_packed_index(spans, chunk, 3, torch.device("cpu"))
    inputs = _inputs(lengths, 4, 2, 4.0, 7)
    x, dt, A, *_ = inputs
    assert (dt[:chunk] * A).sum(dim=0).min().item() < -MAX_CHUNK_LOG_DECAY  # the first chunk decays too much
    with pytest.raises(ValueError, match="no factored form"):
        packed_scan(*inputs, index, form="factored")
    with pytest.raises(ValueError, match="no blocked form"):  # its 16-token blocks are the whole chunk
        packed_scan(*inputs, index, form="blocked")
    scan = packed_scan(*inputs, index)
    assert torch.isfinite(scan.y).all()
    _check_against_one_scan_per_sequence(scan, lengths, inputs, chunk, index.chunk_start)


def test_chunks_whose_blocks_fit_take_the_blocked_form() -> None:
    """64-token chunks that decay by more than MAX_CHUNK_LOG_DECAY but whose 16-token blocks do not
    (a random checkpoint's heads: dt * |A| of a few per token) run the blocked form under "auto",
    exact against one scan per sequence and against the decay-matrix form."""
    lengths, chunk = [150, 40, 64], 64
    spans, at = [], 0
    for i, length in enumerate(lengths):
        spans.append(PrefillSpan(at, length, 1, i, torch.zeros(0, dtype=torch.int64)))
        at += length
    index = build_packed_index(tuple(spans), chunk, 3, torch.device("cpu"))
    inputs = _inputs(lengths, 4, 2, 1.0, 3)
    x, dt, A, *_ = inputs
    log_decay = (dt[:chunk] * A).view(4, 16, 4).sum(dim=1)  # [block, head] of the first chunk
    assert log_decay.sum(dim=0).min().item() < -MAX_CHUNK_LOG_DECAY < log_decay.min().item()
    with pytest.raises(ValueError, match="no factored form"):
        packed_scan(*inputs, index, form="factored")
    scan = packed_scan(*inputs, index)
    blocked = packed_scan(*inputs, index, form="blocked")
    assert torch.equal(scan.y, blocked.y)
    _check_against_one_scan_per_sequence(scan, lengths, inputs, chunk, index.chunk_start)
    _close(scan.y, packed_scan(*inputs, index, form="decay_matrices").y)
