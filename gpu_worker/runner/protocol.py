"""The runner boundary: what the engine, the prefix cache and the worker's API see of a runner, and
nothing else (tests/test_layering.py holds engine/ and cache/ to this module).

A runner owns a model and its pools and executes packed steps. Its contract (`Runner`):

- `execute(batch, sampling, while_waiting)` runs every row's chunk of `batch` (updating the rows' KV
  pages and state slots, saving the checkpoints the rows ask for) and samples one token for each of
  `sampling.rows`, where the logits are: only the token ids, their log-probabilities and the top
  alternatives a row asked for come back (`StepOutput`). A row's tokens depend only on its own chunk,
  state, sampling parameters and (for a seeded row) the position it samples: not on its batch mates, on
  the process it ran in, or on the step. A malformed batch raises InvalidArgumentError and changes
  nothing; any other failure raises, and the step's rows must be treated as lost. `while_waiting` runs
  exactly once, while the step computes where it computes elsewhere (`runs_elsewhere`), else first.
- `runs_elsewhere(batch)`: whether `execute` hands `batch` to another process (then the caller's thread
  is free while it computes).
- `warm_up()` builds what a first step would (gpu_worker.runner.warmup) and blocks until warm; called once,
  from the thread that calls `execute`, before the first step.
- `describe()` sizes and settings for logs and GetInfo; `is_alive()` whether it can execute now (the
  liveness probe); `close()` ends it (idempotent).
- `pools` (`Pools`): the KV page pool and the Mamba state pool, whose bookkeeping (allocation,
  reference counts, checkpoint slots) the engine's allocator and the prefix cache keep in the caller's
  process, plus the checkpoint import and export the prefix cache's tiers use. The caller never writes
  the pools while an `execute` runs.
- `loaded`: the model's facts (config, tokenizer, fingerprint, dtype, generation defaults); `memory`
  the pools' memory split.

Implementations: `gpu_worker.runner.runner.ModelRunner` (in process, on CPU or CUDA: sampling runs on the
device) and `gpu_worker.runner.model_process.ProcessRunner` (the forward and the sampling in model
processes beside the worker). `LogitsRunner` turns a forward that returns logits into `execute`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from gpu_worker.runner.batch import Batch, ForwardOutput, SequenceChunk
from gpu_worker.runner.checkpoint_io import BlockCheckpoint, CheckpointLayout, export_block, import_block
from gpu_worker.runner.history import HistoryTables, HistoryWriter, history_capacity
from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.sampling import (
    MAX_LOGIT_BIAS_TOKENS,
    SamplingParams,
    StepOutput,
    StepSampling,
    TopLogprobs,
    sample_step,
)
from gpu_worker.runner.speculation import Verified, masked_draft_counts, roll_back, verify_drafts
from gpu_worker.runner.state_pool import MambaStatePool
from gpu_worker.runner.step_split import DECODE_ROW_TOKENS, FORWARD_FIXED_TOKENS
from gpu_worker.runner.token_masks import TokenMasks, draft_mask_rows, mask_vocab_size, mask_words

if TYPE_CHECKING:
    from gpu_worker.model.config import ModelConfig
    from gpu_worker.model.loader import LoadedModel
    from gpu_worker.runner.memory import MemorySplit
    from gpu_worker.runner.warmup import WarmupTimes

__all__ = [
    "DECODE_ROW_TOKENS", "FORWARD_FIXED_TOKENS", "MAX_LOGIT_BIAS_TOKENS", "Batch", "BlockCheckpoint",
    "CheckpointLayout", "KVPagePool", "LogitsRunner", "MambaStatePool", "PoolSet", "Pools", "Runner",
    "SamplingParams", "SequenceChunk",
    "StepOutput", "StepSampling", "TokenMasks", "TopLogprobs", "Verified", "mask_vocab_size", "mask_words",
]  # fmt: skip


@runtime_checkable
class Pools(Protocol):
    """KV pages and state slots, through which the allocator and the prefix cache work."""

    @property
    def kv_pool(self) -> KVPagePool: ...
    @property
    def state_pool(self) -> MambaStatePool: ...
    @property
    def kv_page_size_tokens(self) -> int: ...
    @property
    def kv_bytes_per_token(self) -> int: ...
    @property
    def state_bytes_per_request(self) -> int: ...

    def export_block(self, page_ids: list[int], checkpoint_id: int | None) -> BlockCheckpoint:
        """A cached block's KV (and its checkpoint's state, when it has one) copied out to CPU tensors."""
        ...

    def import_block(self, block: BlockCheckpoint, page_ids: list[int], checkpoint_id: int | None) -> None:
        """A verified block written into freshly allocated pages (and a checkpoint slot)."""
        ...

    def checkpoint_layout(self, block_size: int) -> CheckpointLayout:
        """The tensors one block takes (what a shared-tier checkpoint must match)."""
        ...


class PoolSet:
    """The pools of one runner, on its device."""

    def __init__(
        self, kv_pool: KVPagePool, state_pool: MambaStatePool, kv_bytes_per_token: int, state_bytes_per_request: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.kv_bytes_per_token = kv_bytes_per_token
        self.state_bytes_per_request = state_bytes_per_request
        self.device = device

    @property
    def kv_page_size_tokens(self) -> int:
        return self.kv_pool.page_size_tokens

    def export_block(self, page_ids: list[int], checkpoint_id: int | None) -> BlockCheckpoint:
        return export_block(self.kv_pool, self.state_pool, self.device, page_ids, checkpoint_id)

    def import_block(self, block: BlockCheckpoint, page_ids: list[int], checkpoint_id: int | None) -> None:
        import_block(self.kv_pool, self.state_pool, self.device, block, page_ids, checkpoint_id)

    def checkpoint_layout(self, block_size: int) -> CheckpointLayout:
        return CheckpointLayout.of_pools(self.kv_pool, self.state_pool, block_size)


@runtime_checkable
class Runner(Protocol):
    """See the module's docstring for the contract."""

    @property
    def pools(self) -> Pools: ...
    @property
    def loaded(self) -> LoadedModel: ...
    @property
    def config(self) -> ModelConfig: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def memory(self) -> MemorySplit: ...

    def execute(
        self, batch: Batch, sampling: StepSampling, while_waiting: Callable[[], None] | None = None
    ) -> StepOutput: ...
    def runs_elsewhere(self, batch: Batch) -> bool: ...
    def warm_up(self) -> WarmupTimes: ...
    def describe(self) -> dict[str, Any]: ...
    def is_alive(self) -> bool: ...
    def close(self) -> None: ...


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


_MASKS: list[ThreadPoolExecutor] = []
_MASKS_LOCK = threading.Lock()


def _mask_thread() -> ThreadPoolExecutor:
    """The thread that builds a step's token masks beside an in-process forward (started at first use)."""
    with _MASKS_LOCK:
        if not _MASKS:
            _MASKS.append(ThreadPoolExecutor(1, thread_name_prefix="token-masks"))
        return _MASKS[0]


class LogitsRunner:
    """`execute` over a `forward(batch, while_waiting) -> ForwardOutput` that computes logits in this
    process: the rows are sampled where the logits are (on the runner's device). The in-process
    runner is one; so are the engine tests' fakes."""

    _history: HistoryWriter | None = None  # the penalties' state, from the first step that needs it

    def forward(self, batch: Batch, while_waiting: Callable[[], None] | None = None) -> ForwardOutput:
        raise NotImplementedError

    def execute(
        self, batch: Batch, sampling: StepSampling, while_waiting: Callable[[], None] | None = None
    ) -> StepOutput:
        bitmask, before = None, []
        if sampling.masks is None:
            out = self.forward(batch, while_waiting)
        else:
            # The constrained rows' masks are built on the mask thread while the forward runs (the matchers
            # release the GIL), and waited for before sampling; a drafted row's positions have theirs after
            # every row's own (token_masks.draft_mask_rows).
            counts = masked_draft_counts(batch, sampling)
            before = draft_mask_rows(counts, len(sampling.masked))
            words = np.zeros((len(sampling.masked) + sum(counts), sampling.masks.words), dtype=np.int32)
            building = _mask_thread().submit(sampling.masks.fill, words, range(len(sampling.masked)), before)
            try:
                out = self.forward(batch, while_waiting)
            finally:
                wait([building])  # the caller may touch the matchers once execute returns
            building.result()
            bitmask = torch.from_numpy(words)
        if sampling.histories and self._history is None:
            pools = self.pools  # type: ignore[attr-defined]
            kv = pools.kv_pool
            capacity = history_capacity(out.logits.shape[-1], kv.num_pages, kv.page_size_tokens)
            self._history = HistoryWriter(HistoryTables(pools.state_pool.num_slots, capacity, _zeros))
        if self._history is not None:
            self._history.publish(batch, sampling)
        tables = self._history.tables if self._history is not None else None
        rows_masks = bitmask[: len(sampling.masked)] if bitmask is not None else None
        sampled = sample_step(out.logits, batch, sampling, tables, rows_masks, out.stats)
        if out.draft_logits:  # speculation: the drafts checked, the states rolled back to the accepted ones
            sampled = verify_drafts(out, batch, sampling, sampled, tables, bitmask, before)
            roll_back(self.pools.state_pool, batch, sampled.drafts, out.draft_records)  # type: ignore[attr-defined]
        if out.hidden is not None:  # the MTP head's drafts for the next step (gpu_worker.runner.mtp)
            sampled = replace(sampled, proposals=self.propose_mtp(batch, out, sampling, sampled))
        return replace(sampled, prompt_scores=out.prompt_scores) if out.prompt_scores else sampled

    def propose_mtp(
        self, batch: Batch, out: ForwardOutput, sampling: StepSampling, sampled: StepOutput
    ) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """The MTP head's drafts (gpu_worker.runner.mtp); a runner without the head has none."""
        return ()

    def runs_elsewhere(self, batch: Batch) -> bool:
        return False

    def is_alive(self) -> bool:
        return True

    def close(self) -> None:
        return None
