"""Whole decode steps compiled per batch-size bucket (gpu_worker.model.backends.cpu.compiled_step): the
compiled step's logits equal the eager step's within 1e-5 and the pools' state rows and KV within 1e-5,
for every family, on pages that are not consecutive and state slots out of order, with a bucket's
padding rows; a step outside the buckets runs the eager forward without compiling; the setting's checks.

Two runners over one checkpoint step the same requests side by side: one eager (the reference), one
with programs for buckets of 1 and 4 rows (compile time bounded: two graphs per family)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.model.backends.cpu.compiled_step import parse_buckets
from gpu_worker.runner.batch import Batch
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from hybridserve.errors import InvalidArgumentError
from tests.model.model_helpers import FAMILY_SPECS, Request

TOL = 1e-5


def _runner(path: Path, sizes: str) -> ModelRunner:
    cfg = RunnerConfig(
        memory_budget_bytes=8 << 20, kv_page_size_tokens=4, max_num_seqs=8, num_checkpoint_slots=2, device="cpu",
        dtype="float32", compile_step_sizes=sizes,
    )  # fmt: skip
    runner = ModelRunner.from_model_dir(path, cfg)
    runner.warm_up()
    return runner


def _pools(runner: ModelRunner) -> list[torch.Tensor]:
    return [t for pair in runner._kv_caches + runner._states for t in pair]


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_SPECS)
def test_compiled_step_equals_the_eager_step(checkpoints, name: str) -> None:
    hf, path = checkpoints[name]
    vocab = hf.config.vocab_size
    eager, compiled = _runner(path, ""), _runner(path, "1,4")
    assert compiled.decode_steps is not None and compiled.decode_steps.status == "ready", compiled.describe()
    assert eager.decode_steps is None
    compiled.decode_steps.stance = "fail_on_recompile"  # every step below was compiled at warm-up
    prompts = [_prompt(vocab, 5 + 3 * i, seed=i) for i in range(4)]
    pairs = []
    for runner in (eager, compiled):
        spacer = [runner.kv_pool.allocate(1) for _ in range(3)]  # holes: the requests' pages are not consecutive
        runner.state_pool.allocate_slot()  # and their state slots start past 0
        reqs = []
        for i, p in enumerate(prompts):
            reqs.append(Request(runner, p + _prompt(vocab, 8, seed=50 + i)))
            runner.kv_pool.allocate(1)  # a page between each request's pages
        assert spacer
        runner.forward(Batch(tuple(r.chunk(len(p)) for r, p in zip(reqs, prompts, strict=True))))
        pairs.append(reqs)
    # 4 rows (its bucket, slots out of order), 3 (padded to 4), 1 (bucket 1), 2 (padded), then 4 again
    for order in ([2, 0, 3, 1], [3, 1, 0], [2], [1, 3], [0, 1, 2, 3], [3, 2, 1, 0]):
        outs = [runner.forward(Batch(tuple(reqs[i].chunk(1) for i in order))).logits for runner, reqs in
                zip((eager, compiled), pairs, strict=True)]  # fmt: skip
        diff = (outs[0] - outs[1]).abs().max().item()
        assert diff <= TOL, f"{name}: rows {order}: logits differ by {diff}"
        for a, b in zip(_pools(eager), _pools(compiled), strict=True):
            assert torch.allclose(a, b, atol=TOL, rtol=TOL), f"{name}: rows {order}: pools differ"
    assert compiled.describe()["compile_step"] == "ready"
    gaps = [b - a for r in pairs[1] for a, b in zip(r.page_ids, r.page_ids[1:], strict=False)]
    assert any(g != 1 for g in gaps), "the requests' pages were consecutive"


@pytest.mark.slow
def test_a_step_outside_the_buckets_runs_eagerly_without_compiling(checkpoints) -> None:
    hf, path = checkpoints["gqa_groups2"]
    vocab = hf.config.vocab_size
    runner = _runner(path, "1")
    steps = runner.decode_steps
    assert steps is not None and steps.status == "ready"
    steps.stance = "fail_on_recompile"  # a compile would raise
    reqs = [Request(runner, _prompt(vocab, 12, seed=i)) for i in range(3)]
    runner.forward(Batch(tuple(r.chunk(6) for r in reqs)))
    calls = []
    program = steps._program
    steps._program = lambda *a: calls.append(a) or program(*a)  # type: ignore[method-assign]
    out = runner.forward(Batch(tuple(r.chunk(1) for r in reqs)))  # 3 rows: above the largest bucket
    assert out.logits.shape == (3, vocab) and not calls
    mixed = runner.forward(Batch((reqs[0].chunk(1), reqs[1].chunk(2))))  # a prefill chunk: eager too
    assert mixed.logits.shape == (2, vocab) and not calls
    runner.forward(Batch((reqs[2].chunk(1),)))  # one row: its program
    assert len(calls) == 1


def test_compile_step_sizes_setting() -> None:
    assert parse_buckets("", 32) == () and parse_buckets("off", 32) == ()
    assert parse_buckets("auto", 32) == (1, 2, 4, 8)
    assert parse_buckets("auto", 6) == (1, 2, 4, 6)
    assert parse_buckets("8,2, 2", 32) == (2, 8)
    for bad in ("0,2", "one", "2,,x"):
        with pytest.raises(InvalidArgumentError, match="compile_step_sizes"):
            RunnerConfig(compile_step_sizes=bad)
