"""Decode steps under CUDA graphs: one graph per batch-size bucket, captured once at start-up.

A decode step launches a few kernels per layer, each too short to hide its launch cost; replaying a
captured graph launches them all at once. A graph replays fixed addresses and shapes, so:
- every input lives in a static buffer sized for the largest bucket; a step copies its inputs into the
  first rows (one host-to-device copy from pinned memory for the ids, positions and slots, one for the
  used columns of the page table) and pads the rest of its bucket;
- a padded row has position -1 (attention reads 0 keys), KV write slot -1 and state slot -1 (the
  kernels skip it), so it reads and writes nothing in the pools; its logits are dropped;
- the KV pages and state rows are updated in place by the kernels, exactly as in an eager step;
- buckets are captured largest first into one shared memory pool, so the graphs' activations cost about
  one largest-bucket forward (reported as `pool_bytes`).
Steps a graph cannot run (prefill chunks, all-position logits, more sequences than the largest bucket, a
context longer than the page table) run eagerly. Only the CUDA backend's kernels honour padded rows, so
graphs are built only when they are attached. `capture` is injectable: tests pass a stand-in that
records what would be captured and runs the step eagerly.

Verify steps of speculative decoding (`VerifyGraphs`) have graphs of their own, one per bucket of rows:
every row of the step, drafted or not, is a row of L = 1 + k positions through
`decode_program.verify_logits` (the function the CPU compiles; attention through the paged decode kernel,
a position a row), padded as there: a row's padded positions repeat its last real token's K/V and slot
and leave its state as it is (dt = 0), and a bucket's padding rows repeat row 0, writing the same values
to the same places. A plain row beside drafted ones is padded to L too: one launch sequence for the
step, where the eager path runs each drafted row as a prefill chunk of its own. The graphs return every
position's logits and the Mamba layers' span tensors (short_scan.StackedSpanRecord), valid until the next
replay: the step's verification and rollback read them before it."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch

from gpu_worker.model.context import ForwardContext
from gpu_worker.runner.batch import Batch
from gpu_worker.runner.input_builder import PackedInputs, VerifyInputs

DecodeForward = Callable[[torch.Tensor, ForwardContext], torch.Tensor]  # (input_ids, ctx) -> logits [b, vocab]
# (input ids, positions, write slots [b, L]; lengths, state slots [b]; page table [b, W]) -> (logits [b, L, vocab],
# the stacked span tensors): decode_program.verify_logits over the runner's model and pools
VerifyForward = Callable[..., tuple[torch.Tensor, list[torch.Tensor]]]
Replay = Callable[[], None]


class GraphCapture(Protocol):
    """Captures `step` (which reads and writes only static buffers) and returns what replays it."""

    def __call__(self, step: Callable[[], None]) -> Replay: ...


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 2 to 16, of 4 to 32, of 8 to 64, of 16 to 128, of 32 beyond, capped at
    `max_batch`.

    A padded row costs nearly a real row's work (its activations, its share of the matmuls), so a batch
    of more than 8 is padded by less than a quarter; below 8 rows a step costs about its weights read
    whatever the width. 24 graphs for 256 sequences (capture time and pool memory stay small)."""
    steps = [*range(10, 17, 2), *range(20, 33, 4), *range(40, 65, 8), *range(80, 129, 16)]
    sizes = [1, 2, 4, 8, *steps, *range(160, max(max_batch, 160) + 1, 32)]
    return tuple(sorted({s for s in sizes if s < max_batch} | {max_batch}))


def pick_bucket(buckets: tuple[int, ...], num_seqs: int) -> int | None:
    """The smallest bucket that holds `num_seqs` rows; None when none does."""
    for size in buckets:
        if size >= num_seqs:
            return size
    return None


def capture_buckets(
    buckets: tuple[int, ...], capture: GraphCapture, step: Callable[[int], None], device: torch.device
) -> tuple[dict[int, Replay], int]:
    """`step(bucket)` captured for every bucket, largest first (into one pool, the largest's activations
    serve the rest); the replays, and on CUDA the bytes the graphs hold."""
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    replays = {bucket: capture(partial(step, bucket)) for bucket in sorted(buckets, reverse=True)}
    if not cuda:
        return replays, 0
    torch.cuda.synchronize(device)
    return replays, torch.cuda.memory_allocated(device) - before


class CudaGraphCapture:
    """torch.cuda.CUDAGraph capture into one pool shared by every bucket (capture largest first)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __call__(self, step: Callable[[], None]) -> Replay:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, the allocator settles
            step()
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        self.graphs.append(graph)
        return graph.replay


class DecodeGraphs:
    """Static buffers, one captured step per bucket, and the copy-in of a decode batch."""

    def __init__(
        self,
        forward: DecodeForward,
        max_batch: int,
        max_pages_per_seq: int,
        page_size_tokens: int,
        device: torch.device,
        capture: GraphCapture,
    ) -> None:
        self.forward, self.capture, self.device = forward, capture, device
        self.buckets = bucket_sizes(max_batch)
        self.max_batch, self.max_pages, self.page_size = self.buckets[-1], max_pages_per_seq, page_size_tokens
        pin = device.type == "cuda"
        m, w = self.max_batch, max_pages_per_seq
        # rows of `meta`: input ids, positions, KV write slots, state slots  [4, max_batch] int64
        self.meta = torch.zeros(4, m, dtype=torch.int64, device=device)
        self.page_table = torch.zeros(m, w, dtype=torch.int32, device=device)
        self._table_scratch = torch.zeros(m * w, dtype=torch.int32, device=device)
        self._meta_host = torch.zeros(4, m, dtype=torch.int64, pin_memory=pin)
        self._table_host = torch.zeros(m * w, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None  # type: ignore[no-untyped-call]  # staging may be rewritten
        self._no_mask = torch.zeros(0, dtype=torch.bool, device=device)
        self._replays: dict[int, Replay] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.pool_bytes = 0

    @property
    def max_context_tokens(self) -> int:
        return self.max_pages * self.page_size

    def _context(self, bucket: int) -> ForwardContext:
        ids, pos, write_slots, state_slots = self.meta[:, :bucket]
        return ForwardContext(
            positions=pos, kv_write_slots=write_slots, num_decode=bucket, decode_state_slots=state_slots,
            decode_slot_start=None, kv_page_size_tokens=self.page_size, decode_page_table=self.page_table[:bucket],
            decode_kv_mask=self._no_mask, prefills=(),
        )  # fmt: skip

    def _step(self, bucket: int) -> None:
        self._logits[bucket] = self.forward(self.meta[0, :bucket], self._context(bucket))

    def _pad_from(self, row: int) -> None:
        """Rows [row, max_batch) become padding: id 0, position -1, slots -1."""
        self.meta[0, row:] = 0
        self.meta[1:, row:] = -1

    def capture_all(self) -> int:
        """Capture every bucket, largest first; returns the bytes the graphs hold (their shared pool)."""
        self._pad_from(0)  # capture-time runs touch no pool row
        self._replays, self.pool_bytes = capture_buckets(self.buckets, self.capture, self._step, self.device)
        return self.pool_bytes

    def can_run(self, batch: Batch) -> bool:
        """A decode-only batch (one token per sequence) that fits a bucket and the page table."""
        seqs = batch.sequences
        return (
            0 < len(seqs) <= self.max_batch
            and not batch.return_all_logits
            and all(len(s.token_ids) == 1 and s.start_pos < self.max_context_tokens for s in seqs)
        )

    def run(self, packed: PackedInputs) -> torch.Tensor:
        """Replay the bucket of `packed` (built on CPU, decode rows only); logits [num_decode, vocab] in
        packed order, valid until the next `run`."""
        ctx = packed.ctx
        n = ctx.num_decode
        bucket = pick_bucket(self.buckets, n)
        if bucket is None or bucket not in self._replays:
            raise ValueError(f"no captured graph for {n} sequences (buckets {self.buckets})")
        table = ctx.decode_page_table
        width = table.shape[1]
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the staging buffers
        self._meta_host[0, :n] = packed.input_ids
        self._meta_host[1, :n] = ctx.positions
        self._meta_host[2, :n] = ctx.kv_write_slots
        self._meta_host[3, :n] = ctx.decode_state_slots
        self._meta_host[0, n:bucket] = 0
        self._meta_host[1:, n:bucket] = -1
        self._table_host[: n * width].view(n, width).copy_(table)
        self.meta.copy_(self._meta_host, non_blocking=True)  # whole rows: one contiguous copy (32 B a row)
        self._table_scratch[: n * width].copy_(self._table_host[: n * width], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.page_table[:n, :width].copy_(self._table_scratch[: n * width].view(n, width))
        self._replays[bucket]()
        return self._logits[bucket][:n]

    def describe(self) -> dict[str, int | str]:
        return {
            "cuda_graph_buckets": ",".join(str(b) for b in sorted(self._replays)),
            "cuda_graph_pool_bytes": self.pool_bytes,
            "cuda_graph_max_context_tokens": self.max_context_tokens,
        }


class VerifyGraphs:
    """Verify steps under CUDA graphs (module docstring): static buffers for the largest bucket, one
    captured `forward` per bucket of rows, and the copy-in of a step's VerifyInputs."""

    def __init__(
        self,
        forward: VerifyForward,
        max_rows: int,
        length: int,
        max_pages_per_seq: int,
        page_size_tokens: int,
        device: torch.device,
        capture: GraphCapture,
    ) -> None:
        if length < 2:
            raise ValueError(f"a verify row has at least 2 positions, got {length}")
        self.forward, self.capture, self.device = forward, capture, device
        self.buckets = bucket_sizes(max_rows)
        self.length, self.max_pages, self.page_size = length, max_pages_per_seq, page_size_tokens
        m, pin = self.buckets[-1], device.type == "cuda"
        # [3, m, L]: input ids, positions, KV write slots; [2, m]: lengths, state slots; the page table [m, W]
        self.tokens = torch.zeros(3, m, length, dtype=torch.int64, device=device)
        self.rows = torch.zeros(2, m, dtype=torch.int64, device=device)
        self.page_table = torch.zeros(m, max_pages_per_seq, dtype=torch.int64, device=device)
        self._table_scratch = torch.zeros(m * max_pages_per_seq, dtype=torch.int64, device=device)
        self._tokens_host = torch.zeros(3, m, length, dtype=torch.int64, pin_memory=pin)
        self._rows_host = torch.zeros(2, m, dtype=torch.int64, pin_memory=pin)
        self._table_host = torch.zeros(m * max_pages_per_seq, dtype=torch.int64, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None  # type: ignore[no-untyped-call]  # staging may be rewritten
        self._replays: dict[int, Replay] = {}
        self._outputs: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.pool_bytes = 0

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def _step(self, bucket: int) -> None:
        ids, positions, writes = self.tokens[:, :bucket]
        lengths, slots = self.rows[:, :bucket]
        self._outputs[bucket] = self.forward(ids, positions, writes, lengths, slots, self.page_table[:bucket])

    def capture_all(self, scratch_slot: int = 0, scratch_page: int = 0) -> int:
        """Capture every bucket, largest first, on rows of one token at position 0 of `scratch_slot` and
        `scratch_page` (call it before any request holds them: what the capture writes there nobody reads;
        a slot is zeroed or restored when a request takes it, a page written before it is read). Returns
        the bytes the graphs hold."""
        self.tokens.zero_()
        self.tokens[2] = scratch_page * self.page_size
        self.rows[0] = 1
        self.rows[1] = scratch_slot
        self.page_table.fill_(scratch_page)
        self._replays, self.pool_bytes = capture_buckets(self.buckets, self.capture, self._step, self.device)
        return self.pool_bytes

    def can_run(self, batch: Batch) -> bool:
        """Rows that are all a decode's newest token, with or without drafts, at most L tokens, within the
        largest bucket and the page table, with no checkpoint inside a row (a decode row may save one at
        its end)."""
        seqs = batch.sequences
        return (
            0 < len(seqs) <= self.max_rows
            and not batch.return_all_logits
            and all(
                len(s.token_ids) == 1 + s.num_draft_tokens <= self.length
                and not s.boundary_checkpoints
                and not s.score
                and s.start_pos + self.length <= self.max_pages * self.page_size
                for s in seqs
            )
        )

    def run(self, inputs: VerifyInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replay the bucket of `inputs` (built on the host for a bucket: gpu_worker.runner.input_builder.
        build_verify_inputs); the logits [bucket, L, vocab] and span tensors, valid until the next `run`."""
        bucket, length = inputs.input_ids.shape
        width = inputs.page_table.shape[1]
        if bucket not in self._replays or length != self.length or width > self.max_pages:
            raise ValueError(
                f"no captured verify graph for {bucket} rows of {length} tokens over {width} pages (buckets"
                f" {self.buckets} of {self.length} tokens, {self.max_pages} pages)"
            )
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the staging buffers
        self._tokens_host[0, :bucket] = inputs.input_ids
        self._tokens_host[1, :bucket] = inputs.positions
        self._tokens_host[2, :bucket] = inputs.write_slots
        self._rows_host[0, :bucket] = inputs.lengths
        self._rows_host[1, :bucket] = inputs.state_slots
        self._table_host[: bucket * width].view(bucket, width).copy_(inputs.page_table)
        self.tokens.copy_(self._tokens_host, non_blocking=True)
        self.rows.copy_(self._rows_host, non_blocking=True)
        self._table_scratch[: bucket * width].copy_(self._table_host[: bucket * width], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.page_table[:bucket, :width].copy_(self._table_scratch[: bucket * width].view(bucket, width))
        self._replays[bucket]()
        return self._outputs[bucket]

    def describe(self) -> dict[str, int | str]:
        return {
            "cuda_graph_verify_buckets": ",".join(str(b) for b in sorted(self._replays)),
            "cuda_graph_verify_tokens": self.length,
            "cuda_graph_verify_pool_bytes": self.pool_bytes,
        }
