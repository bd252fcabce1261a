"""bfloat16 on CPU (`--dtype bfloat16`, opt-in; `auto` stays float32 there): weights, activations, KV and
conv windows in bfloat16, the SSM state and the logits in float32; the eager step and the compiled
whole step against the float32 path at the stated tolerance, greedy tokens equal where float32's top-2
margin is above it.

BF16_REL_TOL: bfloat16 keeps 8 bits of mantissa (relative error 2^-9 per rounding); across the tiny
models' layers the logits moved by up to 0.014 (dense) and 0.067 (MoE, where bfloat16 router scores
can reorder near-tied experts) x float32's largest logit magnitude in these runs (the test prints what
it measured); 0.1 of it holds those, a wrong kernel (a layer dropped) moves them by far more."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from tests.model.model_helpers import Request

BF16_REL_TOL = 0.1
STEPS = 12


def _runner(path: Path, dtype: str, sizes: str = "") -> ModelRunner:
    cfg = RunnerConfig(
        memory_budget_bytes=8 << 20, kv_page_size_tokens=4, max_num_seqs=4, num_checkpoint_slots=0, device="cpu",
        dtype=dtype, compile_step_sizes=sizes,
    )  # fmt: skip
    runner = ModelRunner.from_model_dir(path, cfg)
    runner.warm_up()
    return runner


def _greedy(runner: ModelRunner, prompt: list[int], forced: list[int] | None) -> tuple[list[int], torch.Tensor]:
    """Greedy decode of STEPS tokens (following `forced` when given, so both runs see the same inputs);
    the tokens chosen and the logits of every step [STEPS, vocab]."""
    from gpu_worker.runner.batch import Batch

    req = Request(runner, prompt + (forced or [0] * STEPS))
    logits = [runner.forward(Batch((req.chunk(len(prompt)),))).logits[0]]
    chosen = [int(logits[-1].argmax())]
    for i in range(STEPS - 1):
        req.token_ids[len(prompt) + i] = forced[i] if forced else chosen[-1]
        logits.append(runner.forward(Batch((req.chunk(1),))).logits[0])
        chosen.append(int(logits[-1].argmax()))
    return chosen, torch.stack(logits)


def test_auto_stays_float32_on_cpu(checkpoints) -> None:
    _, path = checkpoints["gqa_groups2"]
    runner = ModelRunner.from_model_dir(path, RunnerConfig(memory_budget_bytes=8 << 20, device="cpu"))
    assert runner.describe()["dtype"] == "float32"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gqa_groups2", "nemotron_moe"])
def test_bfloat16_matches_float32_within_its_tolerance(checkpoints, name: str) -> None:
    hf, path = checkpoints[name]
    prompt = torch.randint(0, hf.config.vocab_size, (9,), generator=torch.Generator().manual_seed(7)).tolist()
    ref_tokens, ref = _greedy(_runner(path, "float32"), prompt, None)
    for sizes in ("", "1"):  # the eager step, then the compiled whole step
        runner = _runner(path, "bfloat16", sizes)
        assert runner.describe()["dtype"] == "bfloat16"
        assert runner.state_pool.layer_states()[0][1].dtype == torch.float32  # the SSM state stays float32
        tokens, logits = _greedy(runner, prompt, ref_tokens)
        assert logits.dtype == torch.float32
        tol = BF16_REL_TOL * ref.abs().max().item()
        diff = (logits - ref).abs().max().item()
        print(f"{name} ({sizes or 'eager'}): bfloat16 logits within {diff:.4f} of float32's (tolerance {tol:.4f})")
        assert diff <= tol, f"{name} ({sizes or 'eager'}): bfloat16 logits differ by {diff} (tolerance {tol})"
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tol  # float32's choice is beyond bfloat16's reach
        assert clear.any(), "no step with a clear margin: the test would check nothing"
        for step in clear.nonzero()[:, 0].tolist():
            assert tokens[step] == ref_tokens[step], f"{name}: step {step} chose differently"
