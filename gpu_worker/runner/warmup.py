"""Start-up warm-up: what a runner builds before it serves, so that no request pays for a first call.

The parts, each timed in seconds (`WarmupTimes`):
- compile: the Mamba decode step's torch.compile (CPU; gpu_worker.model.backends.cpu.compiled_decode), running
  in a background thread since the runner was built; the warm-up waits for it and attaches it.
- kernels: oneDNN's projection packs and kernels for every row bucket up to `cpu_warm_rows` (CPU;
  gpu_worker.model.backends.cpu.linear.warm_onednn_linears), also a background thread from the start.
- graphs: the CUDA graph capture of decode steps (gpu_worker.runner.cuda_graphs), done while the runner is built.
- steps: a few real steps through the model (`scratch_steps`): a prefill chunk, then decode steps at a few
  batch sizes, which build whatever is still built on a first call (a prefill's Triton kernels on CUDA,
  the first calls of the compiled decode, the allocator's caches). They run on pages and state slots
  taken from the pools for the while and given back after, before the engine allocates anything.

Who waits for it: the worker runs it on its engine thread before the first step and reports readiness
only after it (gpu_worker.api.lifecycle), unless told to serve while warming."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.state_pool import MambaStatePool

# A prefill chunk of this many tokens: several of the CPU scan's 32-token chunks and a whole GPU scan
# chunk, a 16-row multiple for oneDNN; fewer when the KV pool is smaller.
PREFILL_TOKENS = 256
DECODE_BATCH_SIZES = (1, 2, 4, 8)  # the compiled decode's batch-1 and batch-N graphs; more rows than pages


@dataclass(frozen=True, slots=True)
class WarmupTimes:
    """What one runner's warm-up took, each part from its own start to its end (the background parts
    overlap each other and the load); 0 where the part did not run."""

    compile_s: float = 0.0  # the Mamba decode torch.compile, seconds
    kernels_s: float = 0.0  # oneDNN projection packs and kernel builds, seconds
    graphs_s: float = 0.0  # CUDA graph capture, seconds
    steps_s: float = 0.0  # the warm-up steps through the model, seconds
    compile_status: str = "off"  # the decode compile's status at the end: off | attached | failed: ...

    def beside(self, other: WarmupTimes) -> WarmupTimes:
        """The times of two runners that warmed up side by side (model processes): the background parts
        ran at the same time (the longest counts), the steps one after the other (they add up)."""
        return WarmupTimes(
            compile_s=max(self.compile_s, other.compile_s),
            kernels_s=max(self.kernels_s, other.kernels_s),
            graphs_s=max(self.graphs_s, other.graphs_s),
            steps_s=self.steps_s + other.steps_s,
            compile_status=self.compile_status if self.compile_status != "off" else other.compile_status,
        )

    def describe(self) -> str:
        """One log line's worth: `compile 18.2 s (attached), kernels 2.7 s, graphs 0.0 s, steps 0.05 s`."""
        return (
            f"compile {self.compile_s:.1f} s ({self.compile_status}), kernels {self.kernels_s:.1f} s, "
            f"graphs {self.graphs_s:.1f} s, steps {self.steps_s:.2f} s"
        )


@contextmanager
def scratch_steps(kv_pool: KVPagePool, state_pool: MambaStatePool, vocab_size: int) -> Iterator[tuple[Batch, ...]]:
    """The warm-up steps, on pages and state slots taken from the pools for the `with` block and given
    back at its end in the order they were taken (the next allocations hand out the same ids as before).

    Steps: one sequence's prefill chunk of up to PREFILL_TOKENS tokens from a zero state; then a decode
    step for each of DECODE_BATCH_SIZES that the pools can hold: that sequence's next token, beside fresh
    one-token sequences (a zero state, one page each). What the steps write stays in scratch rows nobody
    reads: a fresh sequence's state slot is zeroed by its first chunk and a page is read only up to the
    positions its holder wrote."""
    page_size = kv_pool.page_size_tokens
    sizes = [b for b in DECODE_BATCH_SIZES if b <= state_pool.num_free_slots]
    extra_rows = max(sizes, default=1) - 1
    # the first sequence: prefill tokens [0, n), then its decode at position n, on pages for n + 1 tokens
    n = min(PREFILL_TOKENS, (kv_pool.num_free_pages - extra_rows) * page_size - 1)
    if not sizes or n < 1:
        yield ()
        return
    slots = [state_pool.allocate_slot() for _ in range(extra_rows + 1)]
    tables = [kv_pool.allocate(kv_pool.pages_for_tokens(n + 1))] + [kv_pool.allocate(1) for _ in range(extra_rows)]
    try:
        tokens = tuple(i % vocab_size for i in range(n + 1))
        first = SequenceChunk(tokens[:n], 0, tuple(tables[0]), slots[0])
        steps = [Batch((first,))] if n > 1 else []
        for size in sizes:
            rows = [SequenceChunk((tokens[n],), n, tuple(tables[0]), slots[0])]
            rows += [SequenceChunk((tokens[i],), 0, tuple(tables[i]), slots[i]) for i in range(1, size)]
            steps.append(Batch(tuple(rows)))
        yield tuple(steps)
    finally:
        for table in reversed(tables):
            kv_pool.free(table)
        for slot in reversed(slots):
            state_pool.free_slot(slot)
