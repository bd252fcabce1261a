"""The compiled Mamba decode step (gpu_worker.model.backends.cpu.compiled_decode): logits vs transformers at the parity
tolerance for decode groups in one run of slots, in a few runs and scattered over many (gathered), in
decode-only and mixed steps; no compile after the warm-up on any of those shapes; the setting's checks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gpu_worker.model.backends.cpu.compiled_decode import MAX_RUNS, CompiledMambaDecode, DecodeCompiler, slot_runs
from gpu_worker.model.context import ForwardContext
from gpu_worker.runner.batch import Batch
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from hybridserve.errors import InvalidArgumentError
from tests.model.model_helpers import Request, hf_logits

TOL = 1e-4  # the parity tests' tolerance


def _compiled_runner(path: Path, max_num_seqs: int) -> ModelRunner:
    cfg = RunnerConfig(
        memory_budget_bytes=8 << 20, kv_page_size_tokens=4, max_num_seqs=max_num_seqs, num_checkpoint_slots=4,
        device="cpu", dtype="float32", decode_compile="on",
    )  # fmt: skip
    runner = ModelRunner.from_model_dir(path, cfg)
    compiler = runner.decode_compiler
    assert compiler is not None and compiler.wait(240), "the decode compile did not finish"
    assert compiler.status == "ready", compiler.status
    return runner


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ["gqa_groups2", "conv2_chunk5"])
def test_compiled_decode_matches_reference(checkpoints, name: str) -> None:
    hf, path = checkpoints[name]
    vocab = hf.config.vocab_size
    runner = _compiled_runner(path, max_num_seqs=24)
    # ten requests in state slots 0, 1, 2, 3, then 5, 7, 9, 11, 13, 15 (a held slot before each)
    prompts = [_prompt(vocab, 6 + 3 * i, seed=i) for i in range(10)]
    refs = [hf_logits(hf, p + _prompt(vocab, 12, seed=100 + i)) for i, p in enumerate(prompts)]
    reqs = []
    for i, p in enumerate(prompts):
        if i >= 4:
            runner.state_pool.allocate_slot()
        reqs.append(Request(runner, p + _prompt(vocab, 12, seed=100 + i)))
    assert [r.slot for r in reqs] == [0, 1, 2, 3, 5, 7, 9, 11, 13, 15]

    def check(chosen: list[int], step: Batch) -> None:
        out = runner.forward(step)
        for j, i in enumerate(chosen):
            pos = step.sequences[j].start_pos + len(step.sequences[j].token_ids) - 1
            diff = (out.logits[j] - refs[i][pos]).abs().max().item()
            assert diff <= TOL, f"{name}: request {i} at position {pos}: max abs diff {diff}"

    check(list(range(10)), Batch(tuple(r.chunk(len(p)) for r, p in zip(reqs, prompts, strict=True))))
    assert runner.decode_compiler is not None and runner.decode_compiler.status == "attached"
    compiled = runner.model.blocks[0].mixer.fused_decode
    assert isinstance(compiled, CompiledMambaDecode)
    compiled.stance = "fail_on_recompile"  # every shape below was compiled at warm-up
    # one run from slot 0; one run further in; 7 runs (gathered); one slot; three single-slot runs
    for order in ([0, 1, 2, 3], [3, 2, 1], [9, 0, 1, 2, 3, 4, 5, 6, 7, 8], [9], [6, 0, 5]):
        check(order, Batch(tuple(reqs[i].chunk(1) for i in order)))
    # a mixed step: decodes beside a prefill chunk of request 6 (its own tokens, re-run from position 0)
    fresh = Request(runner, reqs[6].token_ids)
    step = Batch((reqs[0].chunk(1), fresh.chunk(9), reqs[4].chunk(1)))
    out = runner.forward(step)
    assert (out.logits[1] - refs[6][8]).abs().max().item() <= TOL
    assert (out.logits[0] - refs[0][step.sequences[0].start_pos]).abs().max().item() <= TOL


def test_slot_runs_groups_consecutive_slots() -> None:
    def ctx(slots: list[int], start: int | None) -> ForwardContext:
        t = torch.tensor(slots, dtype=torch.int64)
        return ForwardContext(
            positions=t, kv_write_slots=t, num_decode=len(slots), decode_state_slots=t, decode_slot_start=start,
            kv_page_size_tokens=4, decode_page_table=t[:, None], decode_kv_mask=torch.ones(len(slots), 1, 1, 4).bool(),
            prefills=(),
        )  # fmt: skip

    assert slot_runs(ctx([3, 4, 5], 3)) == [(0, 3, 3)]
    assert slot_runs(ctx([0, 1, 4, 5, 6, 9], None)) == [(0, 0, 2), (2, 4, 3), (5, 9, 1)]
    scattered = ctx(list(range(0, 2 * (MAX_RUNS + 1), 2)), None)
    assert len(slot_runs(scattered)) == MAX_RUNS + 1  # more than MAX_RUNS: the gathered path
    cached = replace(scattered)
    assert slot_runs(cached) is slot_runs(cached)  # computed once per forward


def test_decode_compile_setting(checkpoints) -> None:
    _, path = checkpoints["gqa_groups2"]
    with pytest.raises(InvalidArgumentError, match="decode_compile"):
        RunnerConfig(decode_compile="sometimes")
    runner = ModelRunner.from_model_dir(path, RunnerConfig(memory_budget_bytes=8 << 20, decode_compile="off"))
    assert runner.decode_compiler is None and runner.describe()["decode_compile"] == "off"


def test_a_model_without_mamba_layers_decodes_eagerly() -> None:
    compiler = DecodeCompiler(torch.nn.Linear(2, 2), [])
    compiler.start()
    assert compiler.wait(1) and compiler.status.startswith("failed") and not compiler.attach_if_ready()
