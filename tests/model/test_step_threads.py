"""CPU steps take torch's thread count by size: few threads for small (decode) steps, more for
prefill-sized ones; the outputs do not depend on it."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.model_process import resolve_processes
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.tuning import StepThreads, usable_cores
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


def test_a_step_computed_alone_takes_the_lone_threads(restore_threads) -> None:
    """A model process among several: a prefill-sized step runs on `lone` threads while the other
    processes are idle (from its start, or from the block where they have finished); a step they share
    the whole time, and any decode-sized step, on its own thread."""
    idle = [False]
    threads = StepThreads(few=1, many=1, min_tokens=1024, lone=2, lone_min_tokens=64, widen_min_tokens=64)
    threads.others_idle = lambda: idle[0]
    assert torch.get_num_threads() == 1
    assert threads.for_step(300) == 1  # the other process computes its part too
    threads.widen()
    assert threads.current == 1 and torch.get_num_threads() == 1
    idle[0] = True  # ... and has finished it: the next block takes its core
    threads.widen()
    assert threads.current == 2 and torch.get_num_threads() == 2
    assert threads.for_step(8) == 1 and torch.get_num_threads() == 1  # decode rows: one thread
    assert threads.for_step(100, prefill_tokens=0) == 1  # however many
    threads.widen()
    assert threads.current == 1
    assert threads.for_step(300) == 2  # alone from the start
    off = StepThreads(few=1, many=1, min_tokens=1024, lone=1, lone_min_tokens=64)
    off.others_idle = lambda: True
    assert off.for_step(300) == 1
    # taking the cores mid-step only for steps of at least widen_min_tokens
    idle[0] = False
    late = StepThreads(few=1, many=1, min_tokens=1024, lone=2, lone_min_tokens=64, widen_min_tokens=512)
    late.others_idle = lambda: idle[0]
    assert late.for_step(300) == 1
    idle[0] = True
    late.widen()
    assert late.current == 1 and not late.widened
    assert late.for_step(300) == 2 and late.widened  # alone from the start: from lone_min_tokens
    idle[0] = False
    assert late.for_step(600) == 1
    idle[0] = True
    late.widen()
    assert late.current == 2 and late.widened


def test_several_model_processes_lend_their_threads_to_a_lone_step() -> None:
    count, child = resolve_processes(RunnerConfig(model_processes=2, cpu_threads=0))
    assert count == 2 and child.model_process_lone_threads == max(2 * child.cpu_threads, usable_cores() - 1)
    _, given = resolve_processes(RunnerConfig(model_processes=2, cpu_threads=1, model_process_lone_threads=1))
    assert given.model_process_lone_threads == 1  # off, as asked
    _, one = resolve_processes(RunnerConfig(model_processes=1))
    assert one.model_process_lone_threads == 0  # nobody to borrow from
    with pytest.raises(InvalidArgumentError, match="model_process_lone_threads"):
        RunnerConfig(model_process_lone_threads=-1)
