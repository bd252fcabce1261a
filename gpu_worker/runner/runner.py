"""`ModelRunner`: owns the model, the KV page pool and the Mamba state pool; runs one packed batch.

The engine's loop is: build a `Batch` from the plan -> `runner.forward(batch)` -> `sampling.sample(...)`.
The runner knows nothing about requests or queues: the engine allocates pages and slots from
`runner.kv_pool` / `runner.state_pool`, fills page tables, and frees them when a request ends.

The pools are sized by `PoolPlan` (gpu_worker.runner.pool_plan)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpu_worker.model.backends import kernel_backend
from gpu_worker.model.backends.cpu import mamba_prefill
from gpu_worker.model.backends.cpu.linear import (
    pack_limit,
    small_projections,
    use_onednn_linears,
    warm_onednn_linears,
)
from gpu_worker.model.backends.cpu.short_scan import RECORDS_KEY
from gpu_worker.model.loader import LoadedModel, load_model
from gpu_worker.model.mamba2 import Mamba2Mixer
from gpu_worker.runner.batch import Batch, ForwardOutput, score_targets
from gpu_worker.runner.input_builder import PackedInputs, build_inputs
from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.mtp import MtpProposer, Proposals
from gpu_worker.runner.pool_plan import PoolPlan
from gpu_worker.runner.profile import (
    bound_step_memory,
    host_memory_bytes,
    weights_bytes,
)
from gpu_worker.runner.protocol import LogitsRunner
from gpu_worker.runner.sampling import StepOutput, StepSampling
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.shared_memory import Allocator
from gpu_worker.runner.speculation import check_drafted, draft_logits, keeps_short_spans, with_draft_rows
from gpu_worker.runner.state_pool import MambaStatePool
from gpu_worker.runner.step_programs import StepPrograms
from gpu_worker.runner.tuning import StepThreads, decode_threads, set_cpu_threads
from gpu_worker.runner.verify_forward import through_graphs, through_programs
from gpu_worker.runner.warmup import WarmupTimes, scratch_steps

log = logging.getLogger("hybridserve.worker")
# The SSD scan's chunk length is a kernel choice: the result does not depend on it (up to float
# rounding). Checkpoints pick it for GPUs (e.g. 256); on CPU the [chunk x chunk] decay matrices make
# long chunks slow and pad short prompts to a whole chunk (bench/bench_model.py: 16 prompts of 128
# tokens 2.3x faster with 64 than with 256). 32 since the packed scan's transposed chunk states and
# per-chunk carry (bench_prefill, SSD scan ms of a step, 64 -> 32: 32 x 16..256 196 -> 180 and
# 197 -> 174, 4 x 2,000 277 -> 248 and 265 -> 237, 8 x 256 61 -> 56 and 60 -> 59).
CPU_SCAN_CHUNK_TOKENS = 32
# A step a model process computes alone on the other processes' threads too (RunnerConfig.
# model_process_lone_threads) from this many tokens: prefill, whose GEMMs split well. A decode row stays
# on one thread (two threads made one client's decode slower: 5.3 against 4.2 ms a token).
LONE_STEP_MIN_TOKENS = 64
# ... and a step that takes their cores once they have finished their parts, from this many: a long
# prompt's chunk (8 clients, 1,000..3,000-token prompts: 242.8 against 223.5 tok/s); for the short
# chunks of 16..256-token prompts beside decode rows it cost 3% (943.9 against 971.9 tok/s).
WIDEN_MIN_TOKENS = 512


def prompt_scores(
    hidden: torch.Tensor, token_start: tuple[int, ...], batch: Batch, logits_of: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[tuple[int, list[float]], ...]:
    """The scoring rows' prompt log-probabilities (SequenceChunk.score): the logits at every position of
    those rows only (the others computed their last position alone), log-softmaxed, at the next token."""
    out: list[tuple[int, list[float]]] = []
    for i, (start, seq) in enumerate(zip(token_start, batch.sequences, strict=True)):
        if not seq.score:
            continue
        targets = score_targets(seq)
        if not targets:
            out.append((i, []))
            continue
        logp = logits_of(hidden[start : start + len(targets)]).float().log_softmax(dim=-1)
        index = torch.tensor(targets, device=logp.device)[:, None]
        out.append((i, logp.gather(1, index).view(-1).tolist()))
    return tuple(out)


class ModelRunner(StepPrograms, LogitsRunner):
    """Runs packed batches in this process (gpu_worker.runner.protocol.Runner; `forward` gives the logits
    alone). Not thread-safe: one engine thread calls it."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: RunnerConfig,
        alloc: Allocator | None = None,
        pools: tuple[KVPagePool, MambaStatePool] | None = None,
    ) -> None:
        """`alloc` makes the pools' storage (default torch.zeros): the model process builds its pools over
        the worker's shared tensors (gpu_worker.runner.model_process); `pools` runs over existing pools instead
        (the worker's own runner for small steps beside its model process)."""
        self.loaded = loaded
        self.model = loaded.model
        # where the mixers' kernels are read (attached later in tests): the CPU's keep short spans, Triton's not
        self._mixer = next((m for m in self.model.modules() if isinstance(m, Mamba2Mixer)), None)
        self.device = loaded.device
        self.step_threads: StepThreads | None = None
        self._stop_warming = threading.Event()
        self._warming: threading.Thread | None = None
        self._kernels_s = 0.0  # the oneDNN warm-up's seconds, once it ended
        if self.device.type == "cpu":
            self.step_threads = StepThreads(
                few := set_cpu_threads(config.cpu_threads), config.cpu_prefill_threads or few,
                config.cpu_prefill_min_tokens, config.model_process_lone_threads, LONE_STEP_MIN_TOKENS,
                WIDEN_MIN_TOKENS, decode_threads(config, weights_bytes(self.model)),
            )  # fmt: skip
            sequential = mamba_prefill.load() if config.cpu_prefill_scan == "sequential" else False
            self._prefill_scan = "sequential" if sequential else "chunked"
            for module in self.model.modules():
                if isinstance(module, Mamba2Mixer):
                    module.chunk_size = min(module.chunk_size, CPU_SCAN_CHUNK_TOKENS)
                    module.native_prefill = sequential
            self._small_projections = small_projections(config.cpu_small_projections)
            use_onednn_linears(self.model, pack_limit(host_memory_bytes()), self._small_projections == "mkl")
            if config.cpu_warm_rows > 0:  # not a daemon: the interpreter must not end under a oneDNN call
                self._warming = threading.Thread(
                    target=self._warm_linears, args=(config.cpu_warm_rows, config.max_num_seqs), name="warm-linears"
                )
                self._warming.start()
        plan = PoolPlan.of(loaded, config)
        self._set_plan(plan, pools if pools is not None else plan.build(alloc))
        self.step_memory = bound_step_memory(self.model, self.memory, self.device)  # gpu_worker.runner.profile
        caches = self.kv_pool.layer_caches()
        self._kv_caches = caches[: self.config.num_attention_layers]
        self._states = self.state_pool.layer_states()
        self.mtp: MtpProposer | None = None  # the MTP head's drafts (gpu_worker.runner.mtp)
        if self.runner_config.mtp_draft_tokens:
            self.mtp = MtpProposer(
                self.model, caches[self.config.num_attention_layers :], self.kv_page_size_tokens,
                self.state_pool.num_slots, self.runner_config.mtp_draft_tokens, self.device,
            )  # fmt: skip
        self._graphs_s = 0.0  # the CUDA graph capture's seconds
        self.decode_graphs = self._capture_decode_graphs()
        self.verify_graphs = self._capture_verify_graphs()
        self.decode_compiler = self._start_decode_compile()
        self.decode_steps = self._decode_steps()

    def _warm_linears(self, max_rows: int, max_num_seqs: int) -> None:
        started = time.perf_counter()
        head_rows: dict[torch.nn.Module, int] = {self.model.lm_head: max_num_seqs}  # a row per sampled sequence
        calls = warm_onednn_linears(self.model, max_rows, self._stop_warming, head_rows)
        self._kernels_s = time.perf_counter() - started
        log.info("built oneDNN projection kernels for up to %d rows (%d calls) in %.1f s", max_rows, calls,
                 self._kernels_s)  # fmt: skip

    def warm_up(self) -> WarmupTimes:
        """Blocks until this runner is warm (gpu_worker.runner.warmup): the background kernel builds and
        decode compile ended (the compiled step attached), then the warm-up steps ran on scratch pages and
        slots. Call it from the thread that calls `forward`, before the first real step."""
        with scratch_steps(self.kv_pool, self.state_pool, self.config.vocab_size) as steps:
            return self.warm_up_with(steps)

    def warm_up_with(self, steps: tuple[Batch, ...]) -> WarmupTimes:
        """`warm_up` with steps built by the caller (a model process gets them from the worker, which holds
        the pools' bookkeeping)."""
        if self._warming is not None:
            self._warming.join()
        compile_s = 0.0
        if self.decode_compiler is not None:
            self.decode_compiler.wait()
            self.decode_compiler.attach_if_ready()
            compile_s = self.decode_compiler.seconds
        if self.decode_steps is not None:
            compile_s += self._compile_decode_steps(self.decode_steps, steps)
        started = time.perf_counter()
        for batch in steps:
            self.forward(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return WarmupTimes(
            compile_s=compile_s, kernels_s=self._kernels_s, graphs_s=self._graphs_s,
            steps_s=time.perf_counter() - started,
            compile_status=self.decode_compiler.status if self.decode_compiler is not None else "off",
        )  # fmt: skip

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: RunnerConfig | None = None) -> ModelRunner:
        config = config or RunnerConfig()
        return cls(load_model(model_dir, device=config.device, dtype=config.dtype), config)

    @torch.inference_mode()
    def forward(self, batch: Batch, while_waiting: Callable[[], None] | None = None) -> ForwardOutput:
        """Run every sequence's chunk; update KV pages and state slots; save requested checkpoints
        (at a chunk's end, and at the block boundaries inside prefill chunks).

        Each sequence gets exactly the logits it would get alone. Raises InvalidArgumentError for a
        malformed batch (empty chunk, page table too short, duplicate or out-of-range state slot).
        `while_waiting` runs while the forward does where it runs elsewhere (gpu_worker.runner.model_process);
        here, first."""
        if while_waiting is not None:
            while_waiting()
        scoring = any(seq.score for seq in batch.sequences)
        # the MTP head reads every position's hidden state: the eager forward and the CPU programs return
        # them, the CUDA graphs do not
        heads = self.mtp is not None and any(seq.mtp_drafts >= 0 for seq in batch.sequences)
        eager = scoring
        graphs = not scoring and not heads
        if self.decode_graphs is not None and graphs and self.decode_graphs.can_run(batch):
            return self._forward_graphed(batch)
        if self.decode_compiler is not None:  # between steps: switch to the compiled decode once built
            self.decode_compiler.attach_if_ready()
        for seq in batch.sequences:  # boundary checkpoints are written by the mixers: check ids first
            for _, checkpoint_id in seq.boundary_checkpoints:
                self.state_pool.checkpoint_row(checkpoint_id)
        drafting = any(seq.num_draft_tokens for seq in batch.sequences)
        records: list[object] | None = None
        if drafting:  # speculation: a rejected row's state is rebuilt from the short spans, or kept in draft rows
            check_drafted(batch)
            verified = None if eager else self._verify_ahead(batch, heads)
            if verified is not None:
                return verified
            # the CPU mixers keep the short spans; the CUDA backend's kernels (attached on CPU in tests) do not
            keeps = keeps_short_spans(batch, self.device) and (self._mixer is None or self._mixer.ops is None)
            records = [] if keeps else None
            if records is None:
                batch = with_draft_rows(batch, self.state_pool)
        packed = build_inputs(batch, self.kv_page_size_tokens, self.state_pool.num_slots, self.device)
        if records is not None:
            packed.ctx.derived[RECORDS_KEY] = records
        if packed.fresh_slots is not None:
            self.state_pool.zero_slots(packed.fresh_slots)
        if self.step_threads is not None:
            self.step_threads.for_step(len(packed.input_ids), batch.num_prefill_tokens)
        if self.decode_steps is not None and not packed.ctx.prefills and not eager and not batch.return_all_logits:
            # (a drafted row is a multi-token chunk: never here)
            compiled = self._compiled_decode(batch, packed, heads)  # None: no bucket holds it
            if compiled is not None:
                return compiled
        hidden = self.model(packed.input_ids, packed.ctx, self._kv_caches, self._states)  # [T, hidden]
        self._save_checkpoints(batch)
        return self._eager_output(batch, packed, hidden, scoring, heads, drafting, records)

    def _compiled_decode(self, batch: Batch, packed: PackedInputs, heads: bool) -> ForwardOutput | None:
        """A decode-only step through its bucket's compiled program (CPU); None where no bucket holds it."""
        assert self.decode_steps is not None
        compiled = self.decode_steps.run(packed.ctx, packed.input_ids)
        if compiled is None:
            return None
        self._save_checkpoints(batch)
        logits, first_max, lse = (t.index_select(0, packed.last_index) for t in compiled[:3])
        if not heads:
            return ForwardOutput(logits=logits, stats=(first_max, lse))
        return ForwardOutput(logits=logits, stats=(first_max, lse), hidden=compiled[3], token_start=packed.token_start)

    def _eager_output(
        self, batch: Batch, packed: PackedInputs, hidden: torch.Tensor, scoring: bool, heads: bool, drafting: bool,
        records: list[object] | None,
    ) -> ForwardOutput:  # fmt: skip
        """The eager forward's output from its final hidden states [T, hidden]: the last positions' logits,
        the scored rows' prompt log-probabilities, the drafted rows' logits and kept spans (`records`), the
        hidden states where the MTP head reads them, and every position's logits where the batch asks."""
        logits_of = self.model.compute_logits
        scores = prompt_scores(hidden, packed.token_start, batch, logits_of) if scoring else ()
        kept_hidden = hidden if heads else None
        drafts = draft_logits(hidden, packed.token_start, batch, logits_of) if drafting else ()
        kept = None
        if records is not None:
            if len(records) != self.config.num_mamba_layers:  # a mixer path that keeps none (the per-chunk oracle)
                raise RuntimeError(f"{len(records)} of {self.config.num_mamba_layers} Mamba layers kept the spans")
            kept = tuple(records)
        if not batch.return_all_logits:
            last = logits_of(hidden.index_select(0, packed.last_index))
            return ForwardOutput(
                logits=last, prompt_scores=scores, draft_logits=drafts, draft_records=kept, hidden=kept_hidden,
                token_start=packed.token_start,
            )  # fmt: skip
        all_logits = logits_of(hidden)  # [T, vocab] float32
        per_seq = tuple(
            all_logits[start : start + len(seq.token_ids)]
            for start, seq in zip(packed.token_start, batch.sequences, strict=True)
        )
        return ForwardOutput(
            logits=all_logits.index_select(0, packed.last_index),
            all_logits=per_seq,
            prompt_scores=scores,
            draft_logits=drafts,
            draft_records=kept,
            hidden=kept_hidden,
            token_start=packed.token_start,
        )

    def propose_mtp(self, batch: Batch, out: ForwardOutput, sampling: StepSampling, sampled: StepOutput) -> Proposals:
        assert self.mtp is not None
        return self.mtp.propose(batch, out, sampling, sampled)

    def _forward_graphed(self, batch: Batch) -> ForwardOutput:
        """A decode-only step replayed from its bucket's CUDA graph; inputs are packed on the host and
        copied in once (the eager path moves each index tensor separately)."""
        packed = build_inputs(batch, self.kv_page_size_tokens, self.state_pool.num_slots, torch.device("cpu"))
        if packed.fresh_slots is not None:
            self.state_pool.zero_slots(packed.fresh_slots.to(self.device))
        assert self.decode_graphs is not None
        logits = self.decode_graphs.run(packed)  # [num_decode, vocab], packed order
        self._save_checkpoints(batch)
        return ForwardOutput(logits=logits.index_select(0, packed.last_index.to(self.device)))

    def _verify_ahead(self, batch: Batch, heads: bool) -> ForwardOutput | None:
        """A verify step through its CUDA graph or the CPU's compiled programs (gpu_worker.runner.
        verify_forward; the graphs return no hidden states for the MTP head), its checkpoints saved; None
        where neither holds it."""
        page, pool, programs = self.kv_page_size_tokens, self.state_pool, self.decode_steps
        out = None
        if self.verify_graphs is not None and not heads and self.verify_graphs.can_run(batch):
            out = through_graphs(batch, self.verify_graphs, pool, page, self.device)
        elif programs is not None and programs.verify_buckets and not batch.return_all_logits:
            out = through_programs(batch, programs, pool, page, self.device, self.step_threads, heads)
        if out is not None:
            self._save_checkpoints(batch)
        return out

    def _save_checkpoints(self, batch: Batch) -> None:
        for seq in batch.sequences:
            if seq.save_checkpoint_id is not None:
                self.state_pool.save_checkpoint(seq.state_slot, seq.save_checkpoint_id)

    def close(self) -> None:
        """Ends the background kernel warm-up (a call or two away); idempotent."""
        self._stop_warming.set()
        if self._warming is not None:
            self._warming.join()

    def describe(self) -> dict[str, int | str]:
        """Sizes for logs and GetInfo."""
        graphs = self.decode_graphs.describe() if self.decode_graphs is not None else {}
        if self.verify_graphs is not None:
            graphs.update(self.verify_graphs.describe())
        return {
            "architecture": self.config.architecture,
            "kernels": kernel_backend(self.model),
            **graphs,
            "decode_compile": self.decode_compiler.status if self.decode_compiler is not None else "off",
            **(self.decode_steps.describe() if self.decode_steps is not None else {"compile_step": "off"}),
            "device": str(self.device),
            "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "state_bytes_per_request": self.state_bytes_per_request,
            "num_kv_pages": self.kv_pool.num_pages,
            "kv_page_size_tokens": self.kv_page_size_tokens,
            "num_state_slots": self.state_pool.num_slots,
            "num_checkpoint_slots": self.state_pool.num_checkpoint_slots,
            **({"cpu_decode_threads": self.step_threads.decode} if self.step_threads is not None else {}),
            **({"cpu_prefill_scan": self._prefill_scan} if self.device.type == "cpu" else {}),
            **({"cpu_small_projections": self._small_projections} if self.device.type == "cpu" else {}),
        }
