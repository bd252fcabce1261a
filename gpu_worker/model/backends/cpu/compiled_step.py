"""Whole decode steps compiled on CPU, one program per batch-size bucket (what CUDA graphs are on a GPU).

`decode_program.decode_tokens` (token ids to logits through every layer, then each row's greedy token and
log-normaliser) is compiled by torch.compile
(inductor's C++ backend) once per bucket, at start-up: the runner's warm-up calls `compile_all` on a
scratch decode row, and the worker reports ready after it. Every later start reads inductor's on-disk
cache (TORCHINDUCTOR_CACHE_DIR; the worker defaults it to ~/.cache/hybridserve/inductor) and compiles
in seconds. Memory: one program per bucket, its buffers allocated per call.

Shapes. A bucket's batch is static: a graph with a symbolic batch size ran 1.5-2.7x slower at 8 and 32
rows than one specialised to them (inductor's loops lose their constant trip counts). A step of n rows
runs in the smallest bucket b >= n, its first b - n rows repeating the first real row's inputs (token,
position, KV write slot, state slot, page table): they compute what that row computes, and since the
program writes the pools row after row, the real row's own values are written last. The page table's
width is the one dynamic dimension (any context length, at least 2 pages wide: a width of 1 would be a
graph of its own), and the extra pages of a padded width are masked like any key after the position.

Steps the programs do not cover run the eager forward: a prefill or mixed step, all-position logits or
prompt scores, more rows than the largest bucket. Calls run under the "eager_on_recompile" stance, so an
input the warm-up did not foresee (a guard the warm-up did not satisfy) runs the program's Python
eagerly instead of compiling on the serving path: it never waits for a compile.

Verify steps (speculative decoding: rows of the newest token and up to k drafts, beside plain decodes)
have programs of their own when `verify_tokens` L = 1 + k is set: `decode_program.verify_logits` per
bucket of rows, every row padded to L positions (a padded position writes its row's last real K/V again
and leaves the state as it is). They return every position's logits and what each Mamba layer needs to
roll a rejected draft back (short_scan.ShortSpanRecord's inputs), as the eager path's short-span scan does.

Every program is compiled under each thread count its steps may run on (`compile_all`'s `threads`): the
count is part of torch.compile's guards, and a program called on a count it was not compiled for runs
eagerly (gpu_worker.model.backends.cpu.compiled_decode, thread counts).

The decode programs advance each Mamba layer's SSM state through a small C kernel (ssm_update), in place
in one pass, where the machine's C compiler builds it; else through torch's gather and scatter.

The programs return the final hidden states too (after the final norm), which the MTP head reads
(gpu_worker.runner.mtp): the steps where the head runs go through them like any other.

The sampler's part that every row needs is in the program: each row's first maximal token and its
log-normaliser, through the sampler's own C kernel as a custom op (logit_stats), so a plain (greedy) row's
token and log-probability come out of the program. Rows with controls, masks or alternatives are sampled
after it from the logits (gpu_worker.runner.sampling), as after an eager step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from gpu_worker.model.backends.cpu import ssm_update
from gpu_worker.model.backends.cpu.compiled_decode import on_threads
from gpu_worker.model.backends.cpu.decode_program import decode_tokens, verify_logits
from gpu_worker.model.backends.cpu.short_scan import restore_rows
from gpu_worker.model.context import ForwardContext
from gpu_worker.model.model import HybridForCausalLM, KVCaches, StateTensors
from hybridserve.errors import InvalidArgumentError

log = logging.getLogger("hybridserve.worker.compile")
# Each program's wrapper (the code that calls its kernels and extern ops in turn) generated as C++ instead of
# Python (inductor's cpp_wrapper): one thread, benchmark model, ms a step, Python wrapper against C++,
# alternating runs: 1 row 2.30-2.38 / 2.19-2.22, 8 rows 5.40-5.57 / 5.18-5.23 (Intel Xeon); served at 8 clients
# the mean engine step 7.58 / 7.13 ms (bench_ab, 3 rounds: 1.01x output tokens/s, within the noise). A cold
# compile takes longer: test_compiled_step 143 / 168 s on an empty inductor cache.
CPP_WRAPPER = True
STANCE = "eager_on_recompile"
MIN_PAGE_COLUMNS = 2  # the page table's width is dynamic from 2 (inductor specialises a size of 1)
# `auto`'s buckets. Up to 8 rows only, the 32-row steps of 32 clients ran the eager forward: 17.9 ms a
# step served against 14.7 ms for the 32-row program in process (benchmark model, float32, one thread,
# Intel Xeon); with 16 and 32 added, 32 closed-loop clients got 1.14x the output tokens/s at 0.86x the
# ITL (bench/bench_ab.py, bench/RESULTS.md). Each bucket adds about 10 s to a cold start, a second or two
# from inductor's disk cache. Verify programs stay within COMPILED_SPECULATIVE_ROWS (engine settings).
AUTO_BUCKETS = (1, 2, 4, 8, 16, 32)
# logits [b, vocab], first maximal index [b], logsumexp [b], final hidden states [b, hidden]
Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# logits [b, L, vocab], the span tensors, final hidden states [b, L, hidden]
Verified = tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]


def parse_buckets(text: str, max_num_seqs: int) -> tuple[int, ...]:
    """`--compile-step-sizes`: "" or "off" -> none; "auto" -> AUTO_BUCKETS below max_num_seqs, and
    max_num_seqs itself when it is smaller than the largest; else comma-separated positive batch sizes."""
    text = text.strip()
    if text in ("", "off"):
        return ()
    if text == "auto":
        return tuple(sorted({b for b in AUTO_BUCKETS if b < max_num_seqs} | {min(max_num_seqs, AUTO_BUCKETS[-1])}))
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise InvalidArgumentError(
            f"compile_step_sizes must be 'auto', 'off' or comma-separated batch sizes, got {text!r}"
        ) from None
    if not sizes or sizes[0] < 1:
        raise InvalidArgumentError(f"compile_step_sizes must be positive batch sizes, got {text!r}")
    return tuple(sizes)


class CompiledDecodeSteps:
    """The per-bucket compiled decode programs of one model over one set of pools."""

    def __init__(
        self,
        model: HybridForCausalLM,
        kv_caches: KVCaches,
        states: StateTensors,
        page_size: int,
        buckets: tuple[int, ...],
        verify_tokens: int = 0,
        verify_rows: int = 0,
        stacks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`verify_tokens` L > 1 adds verify programs of L positions a row for the buckets of at most
        `verify_rows` rows (and the smallest bucket holding that many), and the rollback's program over
        `stacks`, the conv and SSM storage [layers, rows, ...] that `states` views (short_scan.restore_rows)."""
        self.model, self.kv_caches, self.states, self.page_size = model, kv_caches, states, page_size
        self.buckets = tuple(sorted(buckets))
        self.verify_tokens = verify_tokens if verify_tokens > 1 and stacks is not None else 0
        self.stacks = stacks
        limit = self.bucket_for(verify_rows) or (self.buckets[-1] if self.buckets else 0)
        self.verify_buckets = tuple(b for b in self.buckets if b <= limit) if self.verify_tokens else ()
        self._program: Callable[..., Decoded] = torch.compile(decode_tokens)
        self._verify: Callable[..., Verified] = torch.compile(verify_logits)
        self._restore: Callable[..., None] = torch.compile(restore_rows)
        self.stance = STANCE  # tests use "fail_on_recompile" to prove the warm-up covers serving
        self.status = "compiling"  # compiling | ready | failed: ...
        self.seconds = 0.0
        self.threads: tuple[int, ...] = ()  # the thread counts compiled for, once ready

    def bucket_for(self, num_rows: int) -> int | None:
        """The smallest bucket of at least `num_rows` rows; None when the largest is smaller."""
        return next((b for b in self.buckets if b >= num_rows), None)

    def _inputs(self, ctx: ForwardContext, input_ids: torch.Tensor, bucket: int) -> tuple[torch.Tensor, ...]:
        """The decode group padded to `bucket` rows (padding first, repeating row 0) and the page table to
        at least MIN_PAGE_COLUMNS columns."""
        n = ctx.num_decode
        table = ctx.decode_page_table
        if table.shape[1] < MIN_PAGE_COLUMNS:
            table = torch.nn.functional.pad(table, (0, MIN_PAGE_COLUMNS - table.shape[1]))
        columns = (input_ids, ctx.positions[:n], ctx.kv_write_slots[:n], ctx.decode_state_slots, table)
        if bucket == n:
            return columns
        rows = (torch.arange(bucket) - (bucket - n)).clamp_(min=0)  # 0 for the padding, then 0..n-1
        return tuple(t.index_select(0, rows) for t in columns)

    def run(self, ctx: ForwardContext, input_ids: torch.Tensor) -> Decoded | None:
        """A decode-only step through its bucket's program: logits [num_decode, vocab], each row's first
        maximal token [num_decode], log-normaliser [num_decode] and final hidden state [num_decode, hidden]
        (packed order); None when no bucket holds it (the caller runs the eager forward)."""
        bucket = self.bucket_for(ctx.num_decode)
        if bucket is None or self.status != "ready":
            return None
        ids, pos, write, slots, table = self._inputs(ctx, input_ids, bucket)
        with torch.compiler.set_stance(self.stance):
            logits, first_max, lse, hidden = self._call(ids, pos, write, slots, table)
        real = slice(bucket - ctx.num_decode, None)
        return logits[real], first_max[real], lse[real], hidden[real]

    def verify_bucket_for(self, num_rows: int) -> int | None:
        """The smallest verify bucket of at least `num_rows` rows; None when there is none."""
        return next((b for b in self.verify_buckets if b >= num_rows), None)

    def run_verify(self, *columns: torch.Tensor) -> Verified | None:
        """A verify step's logits [bucket, L, vocab], the Mamba layers' stacked SpanTensors and the final
        hidden states [bucket, L, hidden] through its bucket's program, on `columns` (input ids, positions,
        write slots [bucket, L]; lengths, state slots [bucket]; the page table [bucket, W >= MIN_PAGE_COLUMNS]:
        gpu_worker.runner.input_builder.VerifyInputs); None when the programs are not ready or no bucket
        holds the rows."""
        if self.status != "ready" or columns[0].shape[0] not in self.verify_buckets:
            return None
        with torch.compiler.set_stance(self.stance):
            return self._call_verify(*columns)

    def _call_verify(self, *columns: torch.Tensor) -> Verified:
        return self._verify(self.model, *columns, self.page_size, self.kv_caches, self.states)

    def compile_all(
        self,
        ctx: ForwardContext,
        input_ids: torch.Tensor,
        verify_scratch: Callable[[int], tuple[torch.Tensor, ...]] | None = None,
        threads: tuple[int, ...] = (),
    ) -> None:
        """Compile every bucket on a scratch decode step (one row on scratch state and pages, repeated to
        each bucket's size: what it writes nobody reads), and every verify bucket on `verify_scratch(bucket)`
        (run_verify's columns, of the same scratch row), once under each of `threads` (the thread counts
        the steps run on; none: the current one). Logs and keeps the reason on failure (the steps then
        run eagerly)."""
        started = time.perf_counter()
        ssm_update.load()  # before the traces: decode_program reads whether it is there
        counts = threads or (torch.get_num_threads(),)
        # a bucket's batch stays static (no automatic dynamic after the first bucket); one graph per bucket
        graphs = (len(self.buckets) + 3 * len(self.verify_buckets)) * len(counts)
        limits = {"automatic_dynamic_shapes": False, "recompile_limit": max(8, 2 * graphs)}
        try:
            with torch._dynamo.config.patch(limits), torch._inductor.config.patch(cpp_wrapper=CPP_WRAPPER):
                for count in counts:
                    with on_threads(count):
                        self._compile_buckets(ctx, input_ids)
                        if verify_scratch is not None:
                            self._compile_verify(verify_scratch)
            self.status = "ready"
            self.threads = counts
        except Exception as exc:  # a missing toolchain, an inductor limit: decode stays eager
            self.status = f"failed: {type(exc).__name__}: {exc}"[:300]
            log.warning("decode step compile failed, decoding eagerly: %s", self.status)
        self.seconds = time.perf_counter() - started
        if self.status == "ready":
            sizes = ",".join(map(str, self.buckets))
            verify = f" and verify steps of {self.verify_tokens} tokens a row for {self.verify_sizes} rows"
            log.info("compiled whole decode steps for %s rows%s on %s thread(s) in %.1f s", sizes,
                     verify if self.verify_buckets else "", "/".join(map(str, counts)), self.seconds)  # fmt: skip

    def restore(self, *args: torch.Tensor) -> None:
        """short_scan.restore_rows through its program (StackedSpanRecord.program)."""
        with torch.compiler.set_stance(self.stance), torch.inference_mode():  # as it was compiled
            self._restore(*args)

    def _compile_restore(self, spans: list[torch.Tensor], state_slots: torch.Tensor) -> None:
        """The rollback's graphs for the spans of one verify bucket: one rolled-back row, and (from 2 rows)
        any number (a dynamic count; dynamo specialises a size of 1). The scratch row goes back to the state
        after its newest token, what it held already."""
        assert self.stacks is not None
        spans = [t.detach() for t in spans]
        for count in (1, 2) if spans[0].shape[1] > 1 else (1,):
            rows = torch.zeros(count, dtype=torch.int64)
            args = (*self.stacks, *spans, rows, torch.zeros_like(rows), state_slots[:1].expand(count).clone())
            if count > 1:
                for t in args[-3:]:
                    torch._dynamo.mark_dynamic(t, 0)
            if spans[0].shape[1] > 1:
                for t in spans:
                    torch._dynamo.mark_dynamic(t, 1)
            self._restore(*args)

    def _call(self, *columns: torch.Tensor) -> Decoded:
        return self._program(self.model, *columns, self.page_size, self.kv_caches, self.states)

    def _compile_buckets(self, ctx: ForwardContext, input_ids: torch.Tensor) -> None:
        for bucket in self.buckets:
            ids, pos, write, slots, table = self._inputs(ctx, input_ids, bucket)
            torch._dynamo.mark_dynamic(table, 1)
            self._call(ids, pos, write, slots, table)

    def _compile_verify(self, verify_scratch: Callable[[int], tuple[torch.Tensor, ...]]) -> None:
        for bucket in self.verify_buckets:
            columns = verify_scratch(bucket)
            torch._dynamo.mark_dynamic(columns[-1], 1)
            _, spans, _ = self._call_verify(*columns)
            self._compile_restore(spans, columns[4])

    @property
    def verify_sizes(self) -> str:
        return ",".join(map(str, self.verify_buckets))

    def describe(self) -> dict[str, int | str]:
        verify: dict[str, int | str] = {
            "compile_verify_sizes": self.verify_sizes, "compile_verify_tokens": self.verify_tokens
        }  # fmt: skip
        return {"compile_step_sizes": ",".join(map(str, self.buckets)), "compile_step": self.status,
                "compile_step_threads": "/".join(map(str, self.threads)),
                "compile_step_ssm": "kernel" if ssm_update.LOADED else "torch",
                **(verify if self.verify_buckets else {})}  # fmt: skip
