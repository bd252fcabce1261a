"""The model's packed SSD scan (gpu_worker.model.backends.cpu.packed_scan), in each of its forms,
against the per-sequence scan (`ssd.ssd_scan`) and the einsum packed scan: outputs, final states and the state at every
scan-chunk boundary; chunks that decay beyond the factored form's range take the blocked form, and
blocks that decay beyond it the decay-matrix form, and stay exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.model.backends.cpu.packed_prefill import PackedScan, build_packed_index, packed_ssd_scan
from gpu_worker.model.backends.cpu.packed_scan import MAX_CHUNK_LOG_DECAY, packed_scan
from gpu_worker.model.context import PrefillSpan
from gpu_worker.model.ssd import ssd_scan
from tests.model.model_helpers import assert_scan_close, scan_inputs


def _check_against_one_scan_per_sequence(
    scan: PackedScan, lengths: list[int], inputs: tuple[torch.Tensor, ...], chunk: int, starts: tuple[int, ...]
) -> None:
    x, dt, A, B, C, D, initial = inputs
    at = 0
    for s, length in enumerate(lengths):
        rows = slice(at, at + length)
        chunk_states: list[torch.Tensor] = []
        y_ref, final_ref = ssd_scan(x[rows], dt[rows], A, B[rows], C[rows], D, initial[s], chunk, chunk_states)
        assert_scan_close(scan.y[rows], y_ref)
        assert_scan_close(scan.final_states[s], final_ref)
        count = -(-length // chunk)
        assert_scan_close(scan.chunk_start_states[starts[s] : starts[s] + count], chunk_states[0][:count])
        at += length


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=5),
    geometry=st.sampled_from(
        [(4, 1, 8), (4, 2, 16), (6, 3, 4), (2, 1, 64), (1, 1, 8), (4, 2, 32)]
    ),  # heads, groups, chunk
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
    inputs = scan_inputs(lengths, heads, groups, 0.1, seed)
    scan = packed_scan(*inputs, index, form=form)
    _check_against_one_scan_per_sequence(scan, lengths, inputs, chunk, index.chunk_start)
    einsum_form = packed_ssd_scan(*inputs, index)
    assert_scan_close(scan.y, einsum_form.y)
    assert_scan_close(scan.chunk_start_states, einsum_form.chunk_start_states)


def test_chunks_that_decay_too_much_take_the_decay_matrix_form() -> None:
    """A chunk whose log-decay passes MAX_CHUNK_LOG_DECAY would overflow the factored form's scale
    factors; the scan then uses per-head decay matrices, with the same result as one scan per sequence
    (decays below e^-60 clamped there change nothing float32 shows)."""
    lengths, chunk = [40, 17], 16
    spans = (PrefillSpan(0, 40, 0, 0, torch.zeros(0, dtype=torch.int64)),
             PrefillSpan(40, 17, 0, 1, torch.zeros(0, dtype=torch.int64)))  # fmt: skip
    index = build_packed_index(spans, chunk, 3, torch.device("cpu"))
    inputs = scan_inputs(lengths, 4, 2, 4.0, 7)
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
    inputs = scan_inputs(lengths, 4, 2, 1.0, 3)
    x, dt, A, *_ = inputs
    log_decay = (dt[:chunk] * A).view(4, 16, 4).sum(dim=1)  # [block, head] of the first chunk
    assert log_decay.sum(dim=0).min().item() < -MAX_CHUNK_LOG_DECAY < log_decay.min().item()
    with pytest.raises(ValueError, match="no factored form"):
        packed_scan(*inputs, index, form="factored")
    scan = packed_scan(*inputs, index)
    blocked = packed_scan(*inputs, index, form="blocked")
    assert torch.equal(scan.y, blocked.y)
    _check_against_one_scan_per_sequence(scan, lengths, inputs, chunk, index.chunk_start)
    assert_scan_close(scan.y, packed_scan(*inputs, index, form="decay_matrices").y)


@pytest.mark.parametrize("form", ["auto", "factored", "blocked", "decay_matrices"])
@pytest.mark.parametrize("groups", [1, 2])
def test_one_token_spans_beside_long_ones_start_from_their_own_state(form, groups) -> None:
    """1-token spans, spans of whole chunks and spans that end mid-chunk in one packed scan (mixed
    chunk counts: the carry runs chunk by chunk), each from its own warm state: every span's output,
    chunk-boundary states and final state match one ssd_scan of that span alone, so no state leaks
    across a sequence start, and a 1-token span's state is its initial state decayed plus its token."""
    lengths, chunk = [1, 96, 1, 40, 33, 1, 64], 32
    spans, at = [], 0
    for i, length in enumerate(lengths):
        spans.append(PrefillSpan(at, length, 5, i, torch.zeros(0, dtype=torch.int64)))
        at += length
    index = build_packed_index(tuple(spans), chunk, 3, torch.device("cpu"))
    assert len(set(index.chunk_count)) > 1
    dt_scale = 0.1 if form == "factored" else 1.0  # the factored form needs chunks inside its range
    inputs = scan_inputs(lengths, 4, groups, dt_scale, 11)
    scan = packed_scan(*inputs, index, form=form)
    _check_against_one_scan_per_sequence(scan, lengths, inputs, chunk, index.chunk_start)
    x, dt, A, B, C, D, initial = inputs
    one, row = 2, sum(lengths[:2])  # the third span: one token from its own state, nothing from span 1
    heads_of_group = torch.arange(4) // (4 // groups)
    decay = torch.exp(dt[row] * A)[:, None, None]
    token = (x[row] * dt[row][:, None])[:, :, None] * B[row][heads_of_group][:, None, :]
    assert_scan_close(scan.final_states[one], decay * initial[one] + token)


def test_equal_chunk_counts_and_mixed_counts_carry_alike() -> None:
    """The carry's two paths (every sequence with as many chunks: strided views; mixed counts: one
    multiply-add per chunk) give the same states for the same sequences."""
    chunk = 16
    inputs_equal = scan_inputs([48, 48], 4, 1, 0.1, 5)
    spans = tuple(PrefillSpan(48 * i, 48, 1, i, torch.zeros(0, dtype=torch.int64)) for i in range(2))
    equal = packed_scan(*inputs_equal, build_packed_index(spans, chunk, 3, torch.device("cpu")))
    # the same two sequences with a 5-token one between them: mixed counts
    x, dt, A, B, C, D, initial = inputs_equal
    extra = scan_inputs([5], 4, 1, 0.1, 6)

    def mixed(t: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:48], e, t[48:]])

    inputs_mixed = (mixed(x, extra[0]), mixed(dt, extra[1]), A, mixed(B, extra[3]), mixed(C, extra[4]), D,
                    torch.stack([initial[0], extra[6][0], initial[1]]))  # fmt: skip
    spans_mixed = (PrefillSpan(0, 48, 1, 0, torch.zeros(0, dtype=torch.int64)),
                   PrefillSpan(48, 5, 1, 1, torch.zeros(0, dtype=torch.int64)),
                   PrefillSpan(53, 48, 1, 2, torch.zeros(0, dtype=torch.int64)))  # fmt: skip
    index = build_packed_index(spans_mixed, chunk, 3, torch.device("cpu"))
    mixed_scan = packed_scan(*inputs_mixed, index)
    assert_scan_close(mixed_scan.y[:48], equal.y[:48])
    assert_scan_close(mixed_scan.y[53:], equal.y[48:])
    assert_scan_close(mixed_scan.final_states[[0, 2]], equal.final_states)
    assert_scan_close(mixed_scan.chunk_start_states[[0, 1, 2, 4, 5, 6]], equal.chunk_start_states)
