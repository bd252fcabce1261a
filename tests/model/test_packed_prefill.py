"""The packed prefill (every chunk of a step in one conv and one SSD scan) against the per-sequence
path it replaces (`Mamba2Mixer._prefill`, the oracle): outputs, conv and SSM states, and the state at
every scan-chunk boundary, for random mixes of span lengths, warm states and decodes in the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.model.backends.cpu import mamba_prefill
from gpu_worker.model.backends.cpu.packed_prefill import build_packed_index, packed_causal_conv, packed_ssd_scan
from gpu_worker.model.context import ForwardContext, PrefillSpan
from gpu_worker.model.families import family_named
from gpu_worker.model.mamba2 import Mamba2Mixer
from gpu_worker.model.ssd import ssd_scan
from hybridserve_cli.init_model import ModelSpec

TOL = 1e-5
# The oracle's own float32 error against the recurrence: its chunked scan weighs tokens by exp() of differences
# of cumulative log-decays, which lose digits as the sums grow (mixers here decay by up to 30 a token). On
# lengths [30, 40], seed 387 the oracle's final state was 2.0e-5 from a float64 recurrence, the C kernel's
# 1.3e-7; the packed torch scan shares the oracle's sums and stays within TOL of it.
RECURRENCE_TOL = 1e-4


def _mixer(num_groups: int, d_conv: int, chunk: int, seed: int) -> Mamba2Mixer:
    spec = ModelSpec(hidden_size=32, mamba_n_heads=4, mamba_n_groups=num_groups, mamba_d_state=8,
                     mamba_d_conv=d_conv, mamba_chunk_size=chunk)  # fmt: skip
    config = family_named("bamba").parse(spec.to_hf_config(), "config.json")
    mixer = Mamba2Mixer(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        mixer.dt_bias.copy_(torch.randn(mixer.dt_bias.shape, generator=g) - 1.0)
        mixer.A_log.copy_(torch.log(torch.rand(mixer.A_log.shape, generator=g) * 8 + 0.5))
    return mixer


def _context(num_decode: int, spans: list[tuple[int, int, int]]) -> ForwardContext:
    """spans: (num_tokens, start_pos, state_slot); decodes take slots 0..num_decode-1."""
    prefills, at = [], num_decode
    for n, start, slot in spans:
        prefills.append(PrefillSpan(at, n, start, slot, torch.zeros(0, dtype=torch.int64)))
        at += n
    empty = torch.zeros(0, dtype=torch.int64)
    return ForwardContext(
        positions=torch.zeros(at, dtype=torch.int64), kv_write_slots=torch.zeros(at, dtype=torch.int64),
        num_decode=num_decode, decode_state_slots=torch.arange(num_decode), decode_slot_start=0 if num_decode else None,
        kv_page_size_tokens=4, decode_page_table=empty[None], decode_kv_mask=torch.zeros(0, 1, 1, 4, dtype=torch.bool),
        prefills=tuple(prefills),
    )  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),  # 1-token chunks beside long ones
    warm=st.lists(st.booleans(), min_size=6, max_size=6),
    num_decode=st.integers(0, 3),
    geometry=st.sampled_from([(1, 4, 8), (2, 4, 5), (4, 2, 16), (1, 3, 64)]),  # groups, d_conv, scan chunk
    sequential=st.booleans(),  # the conv and scan in C (backends/cpu/mamba_prefill) or in torch
    seed=st.integers(0, 1000),
)
def test_packed_prefill_matches_one_scan_per_sequence(lengths, warm, num_decode, geometry, sequential, seed) -> None:
    groups, d_conv, chunk = geometry
    mixer = _mixer(groups, d_conv, chunk, seed)
    mixer.native_prefill = sequential and mamba_prefill.load()
    slots = list(range(num_decode, num_decode + len(lengths)))
    spans = [(n, 7 if warm[i] else 0, slots[i]) for i, n in enumerate(lengths)]
    ctx = _context(num_decode, spans)
    g = torch.Generator().manual_seed(seed + 1)
    rows = num_decode + len(lengths) + 2
    conv = torch.randn(rows, mixer.conv_dim, d_conv - 1, generator=g)
    ssm = torch.randn(rows, mixer.num_heads, mixer.head_dim, mixer.state_size, generator=g)
    for _, start, slot in spans:
        if start == 0:  # a fresh sequence starts from a zeroed row (the runner zeroes it)
            conv[slot].zero_()
            ssm[slot].zero_()
    hidden = torch.randn(num_decode + sum(lengths), 32, generator=g)
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    with torch.no_grad():
        mixer.packed_prefill = True
        out = mixer(hidden, ctx, conv, ssm)
        mixer.packed_prefill = False
        ref = mixer(hidden, _context(num_decode, spans), conv_ref, ssm_ref)
    # float32 rounding of two summation orders grows with the values (outputs reach ~3 here): TOL absolute
    # and relative, as torch.testing.assert_close combines them
    tol = RECURRENCE_TOL if mixer.native_prefill else TOL
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(conv, conv_ref, rtol=TOL, atol=TOL)  # the conv is bit for bit in both
    torch.testing.assert_close(ssm, ssm_ref, rtol=tol, atol=tol)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(2, 50), min_size=1, max_size=4), chunk=st.sampled_from([4, 8, 16]),
       seed=st.integers(0, 1000))  # fmt: skip
def test_the_scan_returns_the_state_at_every_chunk_boundary(lengths, chunk, seed) -> None:
    """chunk_start_states[chunk_start[s] + k] is sequence s's state after k * chunk of its tokens."""
    g = torch.Generator().manual_seed(seed)
    heads, p, n, groups = 4, 3, 5, 2
    spans = []
    at = 0
    for i, length in enumerate(lengths):
        spans.append(PrefillSpan(at, length, 1, i, torch.zeros(0, dtype=torch.int64)))
        at += length
    index = build_packed_index(tuple(spans), chunk, 3, torch.device("cpu"))
    x = torch.randn(at, heads, p, generator=g)
    dt = torch.rand(at, heads, generator=g) * 0.5
    A = -torch.rand(heads, generator=g) * 2
    B, C = torch.randn(at, groups, n, generator=g), torch.randn(at, groups, n, generator=g)
    D = torch.randn(heads, generator=g)
    initial = torch.randn(len(lengths), heads, p, n, generator=g)
    scan = packed_ssd_scan(x, dt, A, B, C, D, initial, index)
    for s, span in enumerate(spans):
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        y_ref, final_ref = ssd_scan(x[rows], dt[rows], A, B[rows], C[rows], D, initial[s], chunk)
        assert (scan.y[rows] - y_ref).abs().max().item() <= TOL
        assert (scan.final_states[s] - final_ref).abs().max().item() <= TOL
        for k in range(index.chunk_count[s]):
            cut = slice(span.token_start, span.token_start + k * chunk)
            if k == 0:
                expected = initial[s]
            else:
                _, expected = ssd_scan(x[cut], dt[cut], A, B[cut], C[cut], D, initial[s], chunk)
            assert (scan.chunk_start_states[index.chunk_start[s] + k] - expected).abs().max().item() <= TOL


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),  # spans shorter than the conv too
    d_conv=st.integers(2, 4),
    with_bias=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_packed_conv_is_one_conv1d_per_sequence_bit_for_bit(lengths, d_conv, with_bias, seed) -> None:
    """The packed causal conv (shifted multiply-adds over the packed rows, each span's first d_conv - 1
    rows redone from its conv state) gives exactly F.conv1d over each sequence's [state, tokens]
    window, and leaves each sequence's last d_conv - 1 inputs as its conv state, spans shorter than
    d_conv - 1 (part of the old state stays) and 1-token spans included; so does the C kernel
    (backends/cpu/mamba_prefill.causal_conv) where it builds."""
    g = torch.Generator().manual_seed(seed)
    channels, keep = 6, d_conv - 1
    spans, at = [], 0
    for i, n in enumerate(lengths):
        spans.append(PrefillSpan(at, n, 3, 2 * i + 1, torch.zeros(0, dtype=torch.int64)))  # scattered slots
        at += n
    xbc = torch.randn(at, channels + 3, generator=g)[:, 1 : channels + 1]  # a strided view, as in the mixer
    weight = torch.randn(channels, 1, d_conv, generator=g)
    bias = torch.randn(channels, generator=g) if with_bias else None
    conv_state = torch.randn(2 * len(lengths) + 1, channels, keep, generator=g)
    expected_state = conv_state.clone()
    expected = []
    for span in spans:
        tokens = xbc[span.token_start : span.token_start + span.num_tokens]
        window = torch.cat([conv_state[span.state_slot], tokens.t()], 1)
        expected.append(F.conv1d(window[None], weight, bias, groups=channels)[0].t())
        expected_state[span.state_slot] = window[:, window.shape[1] - keep :]
    index = build_packed_index(tuple(spans), 8, keep, torch.device("cpu"))
    start = conv_state.clone()
    out = packed_causal_conv(xbc, weight, bias, conv_state, index)
    assert torch.equal(out, torch.cat(expected))
    assert torch.equal(conv_state, expected_state)
    if mamba_prefill.load():
        conv_state.copy_(start)
        out = mamba_prefill.causal_conv(xbc, weight, bias, conv_state, index.state_slots, list(lengths))
        assert torch.equal(out, torch.cat(expected))
        assert torch.equal(conv_state, expected_state)
