"""The whole model on the CUDA backend's kernels, against transformers and the torch path, in float32.

Without CUDA this runs the kernels on CPU under Triton's interpreter (tests/conftest.py), so the backend
seam, the packed-prefill metadata and every hook of the model are exercised without a GPU."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.model.backends import attach_kernels, kernel_backend
from gpu_worker.runner.batch import Batch
from tests.model.model_helpers import Request, hf_logits, make_runner, run_schedule

TOL = 1e-4
# CPU tensors through the kernels need the interpreter, which is on only without CUDA (tests/conftest.py);
# on a GPU, tests/model/test_gpu_backend.py runs the same comparisons compiled.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test; CUDA runs test_gpu_backend")


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_backend_is_chosen_at_load_time(small_checkpoint) -> None:
    _, path = small_checkpoint
    runner = make_runner(path)
    assert kernel_backend(runner.model) == "torch"  # CPU: the reference
    assert attach_kernels(runner.model, "triton") == "triton"
    assert kernel_backend(runner.model) == "triton"
    assert attach_kernels(runner.model, "auto") == ("triton" if runner.device.type == "cuda" else "torch")


def test_chunk_schedules_match_transformers(checkpoint) -> None:
    """Prefill chunks over cached context, single-token steps and a chunk ending on a page edge."""
    hf, path = checkpoint
    runner = make_runner(path, page_size=4)
    attach_kernels(runner.model, "triton")
    ids = _prompt(hf.config.vocab_size, 30, 3)
    ref = hf_logits(hf, ids)
    for schedule in ([30], [3, 1, 2, 8, 1, 15], [12, 1, 1, 16]):
        diff = (run_schedule(runner, ids, schedule) - ref).abs().max().item()
        assert diff <= TOL, f"schedule {schedule}: max abs diff {diff}"


def test_packed_mixed_batch_matches_the_torch_path(small_checkpoint) -> None:
    """Decodes in non-contiguous state slots and two prefill chunks (one continuing) in one forward."""
    hf, path = small_checkpoint
    torch_runner, kernel_runner = make_runner(path, page_size=4), make_runner(path, page_size=4)
    attach_kernels(kernel_runner.model, "triton")
    vocab = hf.config.vocab_size
    prompts = [_prompt(vocab, n, seed) for n, seed in ((20, 1), (11, 2), (17, 3), (9, 4))]
    outs = []
    for runner in (torch_runner, kernel_runner):
        filler = Request(runner, [1, 2])  # occupies a slot, so the decode slots are not one run
        reqs = [Request(runner, p) for p in prompts]
        runner.forward(Batch((reqs[0].chunk(18), reqs[2].chunk(6))))
        runner.forward(Batch((reqs[0].chunk(1), reqs[2].chunk(5))))
        step = (reqs[1].chunk(11), reqs[0].chunk(1), reqs[2].chunk(6), reqs[3].chunk(1))  # decodes: slots 1, 4
        out = runner.forward(Batch(step, return_all_logits=True))
        assert out.all_logits is not None
        outs.append(torch.cat(out.all_logits))
        filler.release()
    assert (outs[0] - outs[1]).abs().max().item() <= TOL
