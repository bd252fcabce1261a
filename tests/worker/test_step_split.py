"""How a step is dealt among several model processes (gpu_worker.runner.step_split): decode rows together,
prefill chunks by estimated finish and learned speed; and the prefill chunk cap that lets the processes
share a long prompt's step (--long-prefill-token-threshold on auto)."""

from __future__ import annotations

import pytest

from gpu_worker.api.server import settings_from_args as worker_settings
from gpu_worker.api.server import with_chunk_cap
from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.step_split import Split, prefill_chunk_cap
from hybridserve.errors import InvalidArgumentError
from hybridserve_cli import build_parser
from scheduler_svc.core import MambaCacheMode, SchedulerConfig


def _chunk(num_tokens: int, slot: int) -> SequenceChunk:
    return SequenceChunk(token_ids=(5,) * num_tokens, start_pos=0, page_ids=(slot,), state_slot=slot)


def test_split_keeps_decode_rows_together_and_deals_chunks_by_speed() -> None:
    batch = Batch(tuple(_chunk(n, i) for i, n in enumerate((100, 1, 1, 1, 50, 60, 1, 1))))
    split = Split(2, min_tokens=48)
    parts = split.assign(batch)
    assert sorted(i for p in parts for i in p) == list(range(8))  # every sequence once
    # the decode rows together, with the chunks that even the load; the longest in the second process
    assert parts == [[1, 2, 3, 4, 5, 6, 7], [0]]
    # a decode group alone is never cut, however large; small steps and one process: whole
    assert Split(2, min_tokens=48).assign(Batch(tuple(_chunk(1, i) for i in range(64)))) == [list(range(64))]
    assert Split(2, min_tokens=200).assign(Batch((_chunk(100, 0), _chunk(90, 1)))) == [[0, 1]]
    assert Split(1, min_tokens=0).assign(batch) == [list(range(8))]
    # the second process took twice as long for the same cost: its share falls towards a third, and it
    # is dealt less
    chunks = Batch(tuple(_chunk(n, i) for i, n in enumerate((40, 40, 40, 40, 40, 40))))
    for _ in range(40):
        parts = split.assign(chunks)
        costs = [split.part_cost(chunks, p) for p in parts]
        split.learn(chunks, parts, [costs[0] / 1000, 2 * costs[1] / 1000])
    assert 0.62 < split.shares[0] < 0.70 and abs(sum(split.shares) - 1) < 1e-9
    assert [len(p) for p in split.assign(chunks)] == [4, 2]


def test_the_chunk_cap_lets_the_processes_share_a_steps_prefill() -> None:
    """--long-prefill-token-threshold on auto (-1, the default): the step's budget over the model
    processes, down to the block grid; none with one process, or where the share is under a block; a
    value given stays; below -1 is refused, naming the flag's field and the values it takes."""
    aligned = SchedulerConfig(max_num_batched_tokens=2048, block_size=256)
    assert [prefill_chunk_cap(aligned, n) for n in (1, 2, 3, 4, 8, 9)] == [0, 1024, 512, 512, 256, 0]
    free = SchedulerConfig(max_num_batched_tokens=2048, mamba_cache_mode=MambaCacheMode.NONE)
    assert [prefill_chunk_cap(free, n) for n in (1, 2, 3)] == [0, 1024, 682]

    class Runner:  # the one fact with_chunk_cap reads of a runner
        def __init__(self, processes: int) -> None:
            self.processes = processes

        def describe(self) -> dict[str, int]:
            return {"model_processes": self.processes}

    parser = build_parser(only="worker")
    auto = parser.parse_args(["worker"])
    assert auto.long_prefill_token_threshold == -1
    settings = worker_settings(auto)
    assert settings.scheduler.long_prefill_token_threshold == 0  # until the runner says how many processes
    assert with_chunk_cap(settings, auto, Runner(2)).scheduler.long_prefill_token_threshold == 1024
    assert with_chunk_cap(settings, auto, Runner(1)).scheduler.long_prefill_token_threshold == 0
    small = parser.parse_args(["worker", "--max-num-batched-tokens", "384"])
    assert with_chunk_cap(worker_settings(small), small, Runner(2)).scheduler.long_prefill_token_threshold == 0
    for given in ("0", "512"):
        args = parser.parse_args(["worker", "--long-prefill-token-threshold", given])
        capped = with_chunk_cap(worker_settings(args), args, Runner(2))
        assert capped.scheduler.long_prefill_token_threshold == int(given)
    with pytest.raises(InvalidArgumentError, match=r"long_prefill_token_threshold = -2 .*-1 for auto"):
        worker_settings(parser.parse_args(["worker", "--long-prefill-token-threshold", "-2"]))
