"""The prefill SSD scan as the plain recurrence in C (gpu_worker.model.backends.cpu.mamba_prefill) against the
per-sequence chunked scan (`ssd.ssd_scan`) and the packed chunked scan: outputs, final states and the state
before every scan chunk, at head sizes the kernel keeps in vector registers (16, 32, 64, 128) and others,
on one thread and split over threads; tokens that decay past the log-decay floor; the worker's setting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.model.backends.cpu import mamba_prefill
from gpu_worker.model.backends.cpu.packed_prefill import build_packed_index
from gpu_worker.model.backends.cpu.packed_scan import packed_scan
from gpu_worker.model.context import PrefillSpan
from gpu_worker.model.mamba2 import Mamba2Mixer
from gpu_worker.model.ssd import ssd_scan
from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from hybridserve.errors import InvalidArgumentError
from tests.model.model_helpers import SCAN_REL_TOL, assert_scan_close, scan_inputs

pytestmark = pytest.mark.skipif(not mamba_prefill.load(), reason="no C compiler builds the prefill scan kernel")


def _check(lengths: list[int], inputs, chunk: int, threads: int, rel_tol: float = SCAN_REL_TOL) -> None:
    x, dt, A, B, C, D, initial = inputs
    initial_before = initial.clone()
    scan = mamba_prefill.sequential_scan(*inputs, lengths, chunk, chunk_states=True, threads=threads)
    assert torch.equal(initial, initial_before)  # the caller's states are not written
    at, first = 0, 0
    for s, length in enumerate(lengths):
        rows = slice(at, at + length)
        states: list[torch.Tensor] = []
        y_ref, final_ref = ssd_scan(x[rows], dt[rows], A, B[rows], C[rows], D, initial[s], chunk, states)
        assert_scan_close(scan.y[rows], y_ref, rel_tol)
        assert_scan_close(scan.final_states[s], final_ref, rel_tol)
        count = -(-length // chunk)
        assert_scan_close(scan.chunk_start_states[first : first + count], states[0][:count], rel_tol)
        at, first = at + length, first + count
    assert scan.chunk_start_states.shape[0] == first


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=5),
    geometry=st.sampled_from(
        [(4, 1, 16, 8), (4, 2, 64, 16), (2, 1, 32, 64), (6, 3, 6, 5), (2, 2, 128, 4), (1, 1, 24, 3)]
    ),  # heads, groups, head dim P, state N  # fmt: skip
    chunk=st.sampled_from([4, 16, 32]),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 1000),
)
def test_the_recurrence_matches_the_chunked_scan(lengths, geometry, chunk, threads, seed) -> None:
    heads, groups, p, n = geometry
    _check(lengths, scan_inputs(lengths, heads, groups, 0.1, seed, p, n), chunk, threads)


def test_it_matches_the_packed_scan_on_the_benchmark_geometry() -> None:
    """8 heads of 64, state 64, one group (bench_prefill's model), a short and a long prompt."""
    lengths = [136, 300]
    inputs = scan_inputs(lengths, 8, 1, 0.05, 3, 64, 64)
    spans, at = [], 0
    for i, length in enumerate(lengths):
        spans.append(PrefillSpan(at, length, 0, i, torch.zeros(0, dtype=torch.int64)))
        at += length
    index = build_packed_index(tuple(spans), 32, 3, torch.device("cpu"))
    want = packed_scan(*inputs, index)
    got = mamba_prefill.sequential_scan(*inputs, lengths, 32, chunk_states=True)
    assert_scan_close(got.y, want.y)
    assert_scan_close(got.final_states, want.final_states)
    assert_scan_close(got.chunk_start_states, want.chunk_start_states)
    plain = mamba_prefill.sequential_scan(*inputs, lengths, 32)  # no chunk states asked: none made
    assert plain.chunk_start_states.numel() == 0
    assert torch.equal(plain.y, got.y)


def test_tokens_that_decay_past_the_floor_stay_finite_and_exact() -> None:
    """dt |A| of hundreds on some tokens: the decay is clamped at exp(LOG_FLOOR) ~ 1e-26, which changes
    nothing float32 can hold next to the new token's own term (dt x of 50x the others: 1e-5 relative, the
    rounding of values that large in either scan)."""
    lengths = [40]
    x, dt, A, B, C, D, initial = scan_inputs(lengths, 4, 1, 0.1, 5, 16, 8)
    dt[7], dt[21] = 50.0, 30.0  # dt |A| from 25 to 425
    _check(lengths, (x, dt, A, B, C, D, initial), 16, 1, rel_tol=1e-5)


def test_bad_lengths_are_refused() -> None:
    inputs = scan_inputs([5, 5], 2, 1, 0.1, 0, 16, 4)
    with pytest.raises(ValueError, match="do not add up"):
        mamba_prefill.sequential_scan(*inputs, [5, 4], 4)


def test_the_setting_is_checked() -> None:
    assert RunnerConfig().cpu_prefill_scan == "sequential"
    assert RunnerConfig(cpu_prefill_scan="chunked").cpu_prefill_scan == "chunked"
    with pytest.raises(InvalidArgumentError, match="cpu_prefill_scan must be one of sequential, chunked"):
        RunnerConfig(cpu_prefill_scan="fast")


def test_the_runner_takes_the_kernels_and_both_forms_agree(small_checkpoint) -> None:
    """A CPU runner's mixers take the kernels by default (describe() says so) and the chunked form on request;
    two prompts of 45 and 30 tokens, one keeping the state at two block boundaries inside its chunk, give the
    same logits, live states and checkpoints in both, to float32 rounding."""
    _, path = small_checkpoint
    outputs = {}
    for form in ("sequential", "chunked"):
        config = RunnerConfig(memory_budget_bytes=4 << 20, kv_page_size_tokens=4, max_num_seqs=4,
                              num_checkpoint_slots=4, device="cpu", cpu_prefill_scan=form)  # fmt: skip
        runner = ModelRunner.from_model_dir(path, config)
        assert runner.describe()["cpu_prefill_scan"] == form
        mixers = [m for m in runner.model.modules() if isinstance(m, Mamba2Mixer)]
        assert mixers and all(m.native_prefill == (form == "sequential") for m in mixers)
        pool = runner.state_pool
        kept = (pool.allocate_checkpoint(), pool.allocate_checkpoint())
        first, second = tuple(range(3, 48)), tuple(range(50, 80))
        keep = ((16, kept[0]), (32, kept[1]))  # states after tokens 16 and 32 of the first prompt
        batch = Batch((SequenceChunk(first, 0, tuple(range(12)), 0, boundary_checkpoints=keep),
                       SequenceChunk(second, 0, tuple(range(12, 20)), 1)))  # fmt: skip
        logits = runner.forward(batch).logits
        conv, ssm = pool.stacked_states()
        outputs[form] = (logits, conv[:, :2].clone(), ssm[:, :2].clone(), *pool.export_checkpoint(kept[0]),
                         *pool.export_checkpoint(kept[1]))  # fmt: skip
    _, _, _, _, early, _, late = outputs["sequential"]
    assert early.abs().sum() > 0 and not torch.equal(early, late)  # both checkpoints written, apart
    for got, want in zip(outputs["sequential"], outputs["chunked"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
