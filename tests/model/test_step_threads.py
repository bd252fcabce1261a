"""CPU steps take torch's thread count by size: few threads for small (decode) steps, more for
prefill-sized ones; the outputs do not depend on it."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.batch import Batch, SequenceChunk
from gpu_worker.runner import ModelRunner, RunnerConfig
from hybridserve.errors import InvalidArgumentError


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_steps_switch_thread_counts_by_their_token_count(small_checkpoint, restore_threads) -> None:
    _, path = small_checkpoint
    config = RunnerConfig(memory_budget_bytes=4 << 20, kv_page_size_tokens=4, max_num_seqs=4, device="cpu",
                          cpu_threads=1, cpu_prefill_threads=2, cpu_prefill_min_tokens=8)  # fmt: skip
    runner = ModelRunner.from_model_dir(path, config)
    assert torch.get_num_threads() == 1
    prompt = tuple(range(3, 13))  # 10 tokens: a prefill-sized step here
    long_logits = runner.forward(Batch((SequenceChunk(prompt, 0, (0, 1, 2), 0),))).logits
    assert torch.get_num_threads() == 2
    runner.forward(Batch((SequenceChunk((5,), 10, (0, 1, 2), 0),)))  # one decode token
    assert torch.get_num_threads() == 1

    single = ModelRunner.from_model_dir(path, RunnerConfig(memory_budget_bytes=4 << 20, kv_page_size_tokens=4,
                                                           max_num_seqs=4, device="cpu", cpu_threads=1,
                                                           cpu_prefill_threads=1))  # fmt: skip
    same = single.forward(Batch((SequenceChunk(prompt, 0, (0, 1, 2), 0),))).logits
    assert torch.get_num_threads() == 1
    torch.testing.assert_close(long_logits, same, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("field", ["cpu_prefill_threads", "cpu_prefill_min_tokens"])
def test_thread_settings_are_checked(field) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        RunnerConfig(**{field: -1})
