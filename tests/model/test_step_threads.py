"""CPU steps take torch's thread count by size: few threads for small (decode) steps, more for
prefill-sized ones; the outputs do not depend on it."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.runner import model_process, tuning
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


def test_a_large_model_decodes_on_every_core_on_auto_threads(monkeypatch) -> None:
    """On auto threads, a model of WIDE_DECODE_WEIGHT_BYTES or more decodes on every usable core (its steps
    read the weights from memory, op by op megabytes), in a process among several on its lone threads; a
    smaller one as its other small steps; a count set by hand wins, --cpu-threads included."""
    monkeypatch.setattr(tuning, "usable_cores", lambda: 4)
    monkeypatch.setattr(model_process, "usable_cores", lambda: 4)
    wide, narrow = tuning.WIDE_DECODE_WEIGHT_BYTES, tuning.WIDE_DECODE_WEIGHT_BYTES - 1
    assert tuning.decode_threads(RunnerConfig(), wide) == 4
    assert tuning.decode_threads(RunnerConfig(), narrow) == 3
    assert tuning.decode_threads(RunnerConfig(cpu_decode_threads=2), wide) == 2
    assert tuning.decode_threads(RunnerConfig(cpu_threads=1), wide) == 1
    assert tuning.decode_threads(RunnerConfig(cpu_threads=2), narrow) == 2
    count, child = resolve_processes(RunnerConfig(model_processes=2))  # auto: 1 thread each, lone 3
    assert (count, child.cpu_threads, child.model_process_lone_threads) == (2, 1, 3)
    assert tuning.decode_threads(child, wide) == 3
    assert tuning.decode_threads(child, narrow) == 1
    _, pinned = resolve_processes(RunnerConfig(model_processes=2, cpu_threads=1))
    assert pinned.cpu_decode_threads == 1 and tuning.decode_threads(pinned, wide) == 1


def test_decode_only_steps_take_the_decode_threads(restore_threads) -> None:
    """`decode` threads apply to steps without prompt tokens (plain decode and verify steps); a mixed step
    of a few prompt tokens beside decodes keeps `few`, a prefill-sized one `many`."""
    threads = StepThreads(few=1, many=2, min_tokens=64, decode=2)
    assert threads.for_step(8, 0) == 2 and torch.get_num_threads() == 2
    assert threads.for_step(12, 4) == 1 and torch.get_num_threads() == 1
    assert threads.for_step(100, 96) == 2
    assert threads.for_step(1, 0) == 2
    assert StepThreads(few=1, many=1, min_tokens=64).for_step(1, 0) == 1  # decode unset: `few`
    idle = [False]  # a process among several: wider only while the others are idle
    threads.others_idle = lambda: idle[0]
    assert threads.for_step(8, 0) == 1
    idle[0] = True
    assert threads.for_step(8, 0) == 2


def test_the_runner_sizes_decode_threads_from_its_weights(small_checkpoint, restore_threads, monkeypatch) -> None:
    """The runner reads its model's weight bytes for the decode threads (the tiny test model: below the
    threshold, so the auto count); with the threshold under them, every core, and its decode steps run there."""
    _, path = small_checkpoint
    config = RunnerConfig(memory_budget_bytes=4 << 20, kv_page_size_tokens=4, max_num_seqs=4, device="cpu")
    runner = ModelRunner.from_model_dir(path, config)
    assert runner.describe()["cpu_decode_threads"] == tuning.default_cpu_threads()
    monkeypatch.setattr(tuning, "WIDE_DECODE_WEIGHT_BYTES", 1)
    monkeypatch.setattr(tuning, "usable_cores", lambda: 2)
    wide = ModelRunner.from_model_dir(path, config)
    assert wide.describe()["cpu_decode_threads"] == 2
    wide.forward(Batch((SequenceChunk(tuple(range(3, 9)), 0, (0, 1), 0),)))  # a prompt: the auto count
    assert torch.get_num_threads() == tuning.default_cpu_threads()
    wide.forward(Batch((SequenceChunk((5,), 6, (0, 1), 0),)))
    assert torch.get_num_threads() == 2
