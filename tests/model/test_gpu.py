"""CUDA path: bf16 weights, float32 SSM state. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.runner.batch import Batch
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from tests.model.model_helpers import Request, run_schedule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_bf16_runner_tracks_cpu_float32(family_checkpoint) -> None:
    _, path = family_checkpoint
    cfg = dict(memory_budget_bytes=8 << 20, kv_page_size_tokens=4, max_num_seqs=4, num_checkpoint_slots=2)
    gpu = ModelRunner.from_model_dir(path, RunnerConfig(**cfg))  # auto: cuda + bf16
    cpu = ModelRunner.from_model_dir(path, RunnerConfig(**cfg, device="cpu", dtype="float32"))
    assert gpu.device.type == "cuda" and gpu.loaded.dtype == torch.bfloat16
    assert all(ssm.dtype == torch.float32 for _, ssm in gpu.state_pool.layer_states())
    ids = list(range(1, 40))
    ref = run_schedule(cpu, ids, [39])
    got = run_schedule(gpu, ids, [7, 1, 16, 15]).cpu()
    assert (got - ref).abs().max().item() < 0.1 * ref.abs().max().item()
    req = Request(gpu, ids)
    out = gpu.forward(Batch((req.chunk(39),)))
    assert out.logits.dtype == torch.float32 and out.logits.device.type == "cuda"
