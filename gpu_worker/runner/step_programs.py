"""What a `ModelRunner` builds at start-up so that decode and verify steps skip the eager forward
(`StepPrograms`, a part of ModelRunner):

- on CPU, the Mamba decode step's torch.compile (compiled_decode.DecodeCompiler, in a background thread
  from the start) and the whole-step programs per batch-size bucket, decode and verify
  (compiled_step.CompiledDecodeSteps, compiled by the warm-up on a scratch row), each under every thread
  count its steps may run on;
- on CUDA with the Triton kernels, the CUDA graphs of decode steps and of speculation's verify steps
  (gpu_worker.runner.cuda_graphs), captured while the runner is built."""

from __future__ import annotations

import logging
import time

import torch

from gpu_worker.model.backends import kernel_backend
from gpu_worker.model.backends.cpu.compiled_decode import DecodeCompiler, can_compile, use_persistent_cache
from gpu_worker.model.backends.cpu.compiled_step import MIN_PAGE_COLUMNS, CompiledDecodeSteps, parse_buckets
from gpu_worker.model.backends.cpu.decode_program import verify_logits
from gpu_worker.model.context import ForwardContext
from gpu_worker.model.model import HybridForCausalLM, KVCaches, StateTensors
from gpu_worker.runner.batch import Batch
from gpu_worker.runner.cuda_graphs import CudaGraphCapture, DecodeGraphs, VerifyGraphs
from gpu_worker.runner.input_builder import build_inputs, build_verify_inputs
from gpu_worker.runner.pool_plan import RunnerFacts
from gpu_worker.runner.tuning import StepThreads
from gpu_worker.runner.verify_forward import verify_columns

log = logging.getLogger("hybridserve.worker")


class StepPrograms(RunnerFacts):
    """ModelRunner's compiled programs and captured graphs: how they are built (module docstring)."""

    model: HybridForCausalLM
    step_threads: StepThreads | None
    decode_graphs: DecodeGraphs | None
    _kv_caches: KVCaches
    _states: StateTensors
    _graphs_s: float  # the CUDA graph captures' seconds

    def _start_decode_compile(self) -> DecodeCompiler | None:
        """The background compile of the Mamba decode step (CPU only; see compiled_decode)."""
        mode = self.runner_config.decode_compile
        if mode == "off" or self.device.type != "cpu" or (mode == "auto" and not can_compile(self.device)):
            return None
        use_persistent_cache()
        compiler = DecodeCompiler(self.model, self._states, self._decode_thread_counts())
        compiler.start()
        return compiler

    def _decode_thread_counts(self, max_tokens: int = 1) -> tuple[int, ...]:
        """The thread counts decode steps of up to `max_tokens` tokens run on, which every compiled graph
        is compiled under (StepThreads.decode_counts)."""
        return self.step_threads.decode_counts(max_tokens) if self.step_threads is not None else ()

    def _decode_steps(self) -> CompiledDecodeSteps | None:
        """Whole decode steps compiled per batch-size bucket (CPU only; see compiled_step), compiled by
        the warm-up."""
        buckets = parse_buckets(self.runner_config.compile_step_sizes, self.runner_config.max_num_seqs)
        if not buckets or self.device.type != "cpu" or not can_compile(self.device):
            return None
        use_persistent_cache()
        cfg = self.runner_config
        # the programs return the final hidden states too: the MTP head's steps run through them as well
        verify = cfg.verify_tokens if cfg.verify_tokens > 1 else 0
        rows = cfg.num_draft_rows // (verify - 1) if verify else 0
        return CompiledDecodeSteps(
            self.model, self._kv_caches, self._states, self.kv_page_size_tokens, buckets, verify, rows,
            self.state_pool.stacked_states(),
        )  # fmt: skip

    @torch.inference_mode()
    def _compile_decode_steps(self, programs: CompiledDecodeSteps, steps: tuple[Batch, ...]) -> float:
        """Compile every bucket on the warm-up's first decode step's first row (scratch state and pages);
        returns the seconds it took."""
        scratch = next((b for b in steps if all(len(s.token_ids) == 1 for s in b.sequences)), None)
        if scratch is None:
            programs.status = "failed: no scratch decode step to compile on"
            return 0.0
        one = Batch(scratch.sequences[:1])
        packed = build_inputs(one, self.kv_page_size_tokens, self.state_pool.num_slots, self.device)

        def verify_scratch(bucket: int) -> tuple[torch.Tensor, ...]:  # the same row, one real token
            return verify_columns(build_verify_inputs(
                one, self.kv_page_size_tokens, self.state_pool.num_slots, programs.verify_tokens, bucket,
                MIN_PAGE_COLUMNS,
            ))  # fmt: skip

        verify_tokens = max(programs.verify_buckets, default=0) * programs.verify_tokens
        threads = self._decode_thread_counts(max(max(programs.buckets), verify_tokens))
        programs.compile_all(packed.ctx, packed.input_ids, verify_scratch, threads)
        return programs.seconds

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for decode steps, only on CUDA with the kernels attached (see cuda_graphs)."""
        cfg = self.runner_config
        if self.device.type != "cuda" or cfg.cuda_graph_max_batch == 0 or kernel_backend(self.model) != "triton":
            return None
        started = time.perf_counter()
        max_pages = -(-cfg.cuda_graph_max_context_tokens // cfg.kv_page_size_tokens)
        graphs = DecodeGraphs(
            self._decode_logits, min(cfg.cuda_graph_max_batch, cfg.max_num_seqs), max_pages,
            cfg.kv_page_size_tokens, self.device, CudaGraphCapture(),
        )  # fmt: skip
        with torch.inference_mode():  # as the steps it replays run
            graphs.capture_all()
        self._graphs_s = time.perf_counter() - started
        log.info("captured CUDA graphs of decode steps (%s sequences) in %.1f s", ",".join(map(str, graphs.buckets)),
                 self._graphs_s)  # fmt: skip
        return graphs

    def _capture_verify_graphs(self) -> VerifyGraphs | None:
        """CUDA graphs for speculative decoding's verify steps (cuda_graphs.VerifyGraphs), where decode steps
        have graphs and prompt lookup drafts (the MTP head reads every position's hidden state: its steps
        run eagerly). Steps of up to the rows that may draft: a step that drafts has no more rows."""
        cfg = self.runner_config
        if self.decode_graphs is None or cfg.verify_tokens < 2 or cfg.mtp_draft_tokens or not cfg.num_draft_rows:
            return None
        started = time.perf_counter()
        rows = min(cfg.num_draft_rows // (cfg.verify_tokens - 1), cfg.max_num_seqs, cfg.cuda_graph_max_batch)
        graphs = VerifyGraphs(
            self._verify_step, max(rows, 1), cfg.verify_tokens, self.decode_graphs.max_pages, cfg.kv_page_size_tokens,
            self.device, CudaGraphCapture(),
        )  # fmt: skip
        with torch.inference_mode():
            graphs.capture_all()
        seconds = time.perf_counter() - started
        self._graphs_s += seconds
        log.info("captured CUDA graphs of verify steps (%s rows of %d tokens) in %.1f s",
                 ",".join(map(str, graphs.buckets)), cfg.verify_tokens, seconds)  # fmt: skip
        return graphs

    def _verify_step(
        self, ids: torch.Tensor, positions: torch.Tensor, writes: torch.Tensor, lengths: torch.Tensor,
        slots: torch.Tensor, table: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
        """A captured verify step: decode_program.verify_logits over this runner's model and pools."""
        page = self.kv_page_size_tokens
        logits, spans, _ = verify_logits(self.model, ids, positions, writes, lengths, slots, table, page,
                                         self._kv_caches, self._states)  # fmt: skip
        return logits, spans

    def _decode_logits(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The captured step: forward and float32 logits of every row."""
        return self.model.compute_logits(self.model(input_ids, ctx, self._kv_caches, self._states))
