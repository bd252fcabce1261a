"""The Mamba state at block boundaries inside a prefill chunk (gpu_worker/model/boundary_states.py)
equals the state a chunk ending there leaves, for every family and for boundaries on and off the
scan's chunk grid, in a batch with other spans and on a chunk that continues an earlier one."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.model.backends import reference
from gpu_worker.model.backends.cuda import ops as ops_module
from gpu_worker.model.mamba2 import Mamba2Mixer
from gpu_worker.runner.batch import Batch
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from hybridserve.errors import InvalidArgumentError
from tests.model.model_helpers import FAMILY_SPECS, SPECS, Request, make_hf_model, make_runner, save_hf_model


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.parametrize("packed", [True, False], ids=["packed scan", "one scan per chunk"])
@pytest.mark.parametrize("name", [*FAMILY_SPECS, "conv2_chunk5"])
def test_states_inside_a_chunk_equal_the_states_where_a_chunk_ends(name, packed, tmp_path, monkeypatch):
    monkeypatch.setattr(Mamba2Mixer, "packed_prefill", packed)
    spec = SPECS[name]
    runner = make_runner(save_hf_model(make_hf_model(spec), tmp_path))
    tokens, other = _tokens(spec.vocab_size, 40, 1), _tokens(spec.vocab_size, 30, 2)
    # offsets inside the chunk: on the scan grid (multiples of the scan chunk) and off it, and 1
    # token past the start (less than the conv window)
    positions = (6, 5 + spec.mamba_chunk_size, 13, 37)
    request, neighbour = Request(runner, tokens), Request(runner, other)
    runner.forward(Batch((request.chunk(5),)))  # the chunk under test continues from position 5
    chunk = request.chunk(35)._replace(boundary_checkpoints=tuple((p, i) for i, p in enumerate(positions)))
    runner.forward(Batch((neighbour.chunk(30), chunk)))  # a second span before it in the batch
    kept = runner.state_pool.layer_states()
    for checkpoint_id, position in enumerate(positions):
        reference = Request(runner, tokens)
        runner.forward(Batch((reference.chunk(position),)))
        row = runner.state_pool.checkpoint_row(checkpoint_id)
        for conv, ssm in kept:
            torch.testing.assert_close(conv[row], conv[reference.slot], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ssm[row], ssm[reference.slot], rtol=1e-5, atol=1e-5)
        reference.release()


def test_a_boundary_checkpoint_outside_its_chunk_is_invalid_argument(tmp_path):
    spec = SPECS["gqa_groups2"]
    runner = make_runner(save_hf_model(make_hf_model(spec), tmp_path))
    request = Request(runner, _tokens(spec.vocab_size, 20, 3))
    for bad in ((20, 0), (0, 0), (8, 99)):  # the chunk's end, its start, an unknown checkpoint slot
        chunk = request.chunk(20)._replace(boundary_checkpoints=(bad,))
        request.num_computed = 0
        with pytest.raises(InvalidArgumentError):
            runner.forward(Batch((chunk,)))


def test_a_checkpoint_memory_budget_sets_the_number_of_checkpoint_slots(tmp_path):
    path = save_hf_model(make_hf_model(SPECS["gqa_groups2"]), tmp_path)
    per_state = make_runner(path).state_bytes_per_request
    config = RunnerConfig(
        memory_budget_bytes=8 << 20, kv_page_size_tokens=4, checkpoint_memory_bytes=3 * per_state + 1, device="cpu"
    )
    runner = ModelRunner.from_model_dir(path, config)
    assert runner.state_pool.num_checkpoint_slots == 3
    assert runner.describe()["num_checkpoint_slots"] == 3


class _ReferenceMambaKernels:
    """The Triton Mamba kernels' contract (backends/reference.py) behind the kernels' signatures, so
    the CUDA backend's mixer path (TritonOps.mamba_mix) runs on CPU."""

    @staticmethod
    def conv_varlen(x, conv_state, weight, bias, spans):
        return reference.conv_varlen(x, conv_state, weight, bias, [tuple(s) for s in spans.tolist()])


@pytest.mark.parametrize("name", ["gqa_groups2", "conv2_chunk5"])
def test_the_kernel_path_keeps_the_same_boundary_states(name, tmp_path, monkeypatch):
    """TritonOps.mamba_mix (the CUDA backend's mixer path, its conv kernel swapped for the reference
    loop) writes the same boundary states as the reference mixer."""
    monkeypatch.setattr(ops_module, "mamba_k", _ReferenceMambaKernels)
    spec = SPECS[name]
    path = save_hf_model(make_hf_model(spec), tmp_path)
    states = []
    for use_ops in (False, True):
        runner = make_runner(path)
        if use_ops:
            for module in runner.model.modules():
                if isinstance(module, Mamba2Mixer):
                    module.ops = ops_module.TritonOps()
        request = Request(runner, _tokens(spec.vocab_size, 30, 4))
        runner.forward(Batch((request.chunk(3),)))
        chunk = request.chunk(27)._replace(boundary_checkpoints=((4, 0), (3 + spec.mamba_chunk_size, 1), (29, 2)))
        runner.forward(Batch((chunk,)))
        rows = [runner.state_pool.checkpoint_row(i) for i in range(3)]
        states.append([(conv[rows].clone(), ssm[rows].clone()) for conv, ssm in runner.state_pool.layer_states()])
    for (conv_ref, ssm_ref), (conv_ops, ssm_ops) in zip(*states, strict=True):
        assert conv_ref.abs().sum() > 0 and ssm_ref.abs().sum() > 0
        torch.testing.assert_close(conv_ops, conv_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ssm_ops, ssm_ref, rtol=1e-5, atol=1e-5)
