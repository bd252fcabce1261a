"""How a step's sequences are dealt among several model processes (gpu_worker.runner.model_process): which
process computes which sequences, from an estimate of each one's cost and each process's learned speed."""

from __future__ import annotations

from typing import Any

from gpu_worker.runner.batch import Batch
from scheduler_svc.core import SchedulerConfig

DECODE_ROW_TOKENS = 2.5  # a decode row costs about as much as this many prefill tokens (bench_decode vs bench_prefill)
# what any forward costs before its first token, in prefill tokens (weights streamed, per-op overhead): a
# decode step of the benchmark model, one thread, 6.44 ms at 16 rows and 10.94 ms at 32 (bench_decode),
# a prefill token ~0.11 ms (bench_prefill): ~18 tokens. Cutting a decode group in two pays it twice.
FORWARD_FIXED_TOKENS = 18.0


class Split:
    """How a step's sequences are shared among the model processes, as index lists into the batch (the
    logits are put back in batch order). The decode rows stay together, in the first part: a decode group
    cut in two costs each process nearly as much as the whole (the weights are read per forward, not per
    row); a decode with drafts (speculation) is one of them, its draft states kept in draft rows that are
    dealt per forward. The prefill chunks are then dealt, longest first, to the part whose estimated finish (fixed cost
    + tokens, a decode row counting DECODE_ROW_TOKENS, over its process's share) is earliest. Shares are
    learned from how long each process's last part took (its core may be busy with the worker's threads)."""

    def __init__(self, count: int, min_tokens: int) -> None:
        self.count = count
        self.min_tokens = min_tokens
        self.shares = [1.0 / count] * count

    @staticmethod
    def cost(seq: Any) -> float:
        n = len(seq.token_ids)
        return DECODE_ROW_TOKENS if n == 1 else DECODE_ROW_TOKENS + seq.num_draft_tokens if seq.num_draft_tokens else n

    def assign(self, batch: Batch) -> list[list[int]]:
        """Index lists, one per process that gets work (one list: the whole batch in the first process)."""
        seqs = batch.sequences
        whole = [list(range(len(seqs)))]
        if self.count == 1 or len(seqs) < 2:
            return whole
        costs = [self.cost(s) for s in seqs]
        if sum(costs) < self.min_tokens:
            return whole
        decode = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1 or s.num_draft_tokens]
        prefill = sorted((i for i, s in enumerate(seqs) if len(s.token_ids) > 1 and not s.num_draft_tokens),
                         key=lambda i: -costs[i])  # fmt: skip
        parts: list[list[int]] = [[] for _ in range(self.count)]
        load = [0.0] * self.count
        if decode:
            parts[0] = decode
            load[0] = FORWARD_FIXED_TOKENS + DECODE_ROW_TOKENS * len(decode)
        for i in prefill:  # an empty part pays the forward's fixed cost with its first chunk
            added = [costs[i] + (0.0 if parts[k] else FORWARD_FIXED_TOKENS) for k in range(self.count)]
            k = min(range(self.count), key=lambda k: (load[k] + added[k]) / self.shares[k])
            load[k] += added[k]
            parts[k].append(i)
        used = [sorted(p) for p in parts if p]
        return used if len(used) > 1 else whole

    def part_cost(self, batch: Batch, part: list[int]) -> float:
        return FORWARD_FIXED_TOKENS + sum(self.cost(batch.sequences[i]) for i in part)

    def learn(self, batch: Batch, parts: list[list[int]], seconds: list[float]) -> None:
        """Moves each process's share a fifth of the way towards its part of the speed they showed (cost
        per second of compute) on the step just run; only steps that used every process teach."""
        if len(parts) != self.count:
            return
        rates = [self.part_cost(batch, p) / max(t, 1e-6) for p, t in zip(parts, seconds, strict=True)]
        total = sum(rates)
        for i, r in enumerate(rates):
            self.shares[i] = 0.8 * self.shares[i] + 0.2 * (r / total)


def prefill_chunk_cap(config: SchedulerConfig, processes: int) -> int:
    """The per-request prefill chunk cap (long_prefill_token_threshold) under which `processes` model
    processes share a step's prefill: one sequence's chunk runs in one process (a Mamba prefill is
    sequential), so an uncapped long prompt fills a step by itself while the other processes wait for it.
    Capped, the step's budget holds chunks of several prompts, and Split deals them out. The budget
    (max_num_batched_tokens) over the processes, down to the block grid where chunks must end on it;
    0 (no cap) with one process, or where that share would be under one block."""
    if processes <= 1:
        return 0
    grid = config.block_size if config.is_aligned else 1
    cap = config.max_num_batched_tokens // processes // grid * grid
    return cap if cap >= grid else 0
