"""`RunnerConfig`: the worker-side model settings (the pools, the device, CPU threads, model processes),
a plain dataclass that the engine's settings hold without loading the runner."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.errors import InvalidArgumentError

DECODE_COMPILE_MODES = ("auto", "on", "off")
PREFILL_SCANS = ("sequential", "chunked")
SMALL_PROJECTIONS = ("auto", "mkl", "onednn")


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """Worker-side model settings, built once from flags."""

    # KV pages + state slots + checkpoints (bytes); 0 = auto: on CUDA gpu_memory_utilization of the device,
    # on CPU CPU_MEMORY_BUDGET_BYTES
    memory_budget_bytes: int = 0
    gpu_memory_utilization: float = 0.9  # on CUDA: the fraction of the device's memory this worker may use
    max_num_batched_tokens: int = 2048  # the largest step (tokens), profiled for the activation budget
    max_model_len: int = 0  # the longest context a step attends over (activation budget); 0 = max_position_embeddings
    kv_page_size_tokens: int = 16  # tokens per KV page
    max_num_seqs: int = 32  # live Mamba state slots = most requests running at once
    num_checkpoint_slots: int = 64  # Mamba state checkpoints kept on the worker (one per cached block)
    checkpoint_memory_bytes: int = 0  # when > 0, the checkpoint slots are as many as fit in it (bytes)
    device: str = "auto"  # auto | cpu | cuda[:i]
    dtype: str = "auto"  # auto (bf16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16
    cuda_graph_max_batch: int = 256  # decode steps up to this many sequences replay CUDA graphs; 0 = off
    cuda_graph_max_context_tokens: int = 32768  # longer contexts decode eagerly (sizes the graphs' page table)
    cpu_threads: int = 0  # torch intra-op threads when running on CPU; 0 = auto (tuning.default_cpu_threads)
    # threads for CPU steps of at least cpu_prefill_min_tokens tokens; 0 = cpu_threads throughout (off)
    cpu_prefill_threads: int = 0
    cpu_prefill_min_tokens: int = 1024
    # threads for CPU steps without prompt tokens (decode, verify); 0 = auto (tuning.decode_threads): every
    # usable core for a model of 128 MiB or more (a process among several: while the others are idle),
    # else cpu_threads
    cpu_decode_threads: int = 0
    # the prefill's SSD scan on CPU: sequential = the plain recurrence in C (backends/cpu/mamba_prefill; the
    # chunked form where no C compiler builds it) | chunked = chunked GEMMs (backends/cpu/packed_scan)
    cpu_prefill_scan: str = "sequential"
    # float32 projections of under 2 MB of weight at up to 32 rows on CPU: mkl = F.linear (MKL's sgemm) | onednn =
    # oneDNN on prepacked weights from 3 rows | auto = mkl where MKL takes its AVX-512 path (Intel), else onednn
    # (gpu_worker.model.backends.cpu.linear.MKL_MAX_BYTES)
    cpu_small_projections: str = "auto"
    # torch.compile the Mamba decode step on CPU, in the background at start-up (eager until it is ready):
    # auto = when a C++ compiler is found | on | off (gpu_worker.model.backends.cpu.compiled_decode)
    decode_compile: str = "off"
    # on CPU, compile whole decode steps (embedding to logits) for these batch sizes at start-up, one program
    # per size; a step of n rows runs in the smallest size >= n (gpu_worker.model.backends.cpu.compiled_step):
    # "" / "off" = none | "auto" = 1,2,4,8,16,32 up to max_num_seqs | "1,2,4,..."
    compile_step_sizes: str = ""
    # run the forward in a child process beside the worker (gpu_worker.runner.model_process): auto = on CPU
    # (Linux), never on CUDA | on | off
    model_process: str = "off"
    # with a model process: steps of fewer rows than this run in the worker's own process (no hand-off
    # between processes; the worker then keeps a copy of the weights); 0 = every step in the model process
    model_process_min_rows: int = 0
    # model processes sharing each step (the decode rows together, prefill chunks dealt by each one's speed);
    # 0 = auto: two on a CPU with at least two usable cores (gpu_worker.runner.model_process.resolve_processes)
    model_processes: int = 0
    # a step splits among the model processes from this many tokens (a decode row counting 2.5)
    model_process_split_min_tokens: int = 48
    # with several model processes: threads of a process's step while the others are idle (from the start
    # with the whole step, LONE_STEP_MIN_TOKENS prefill tokens; from the block where they finished,
    # WIDEN_MIN_TOKENS); 0 = auto (gpu_worker.runner.model_process.resolve_processes: the cores but one, at least
    # the processes' threads together), 1 = off
    model_process_lone_threads: int = 0
    # on CPU, build oneDNN's projection kernels for every row bucket up to this many rows in a background
    # thread at start-up (gpu_worker.model.backends.cpu.linear); 0 = each on its first use
    cpu_warm_rows: int = 0
    # state rows beside the live slots where a speculative step keeps the state after each draft token, so a
    # rejected draft rolls back without a second forward (gpu_worker.runner.speculation); 0 = no speculation.
    # The engine sets it: --num-speculative-tokens times the rows that may draft in one step.
    num_draft_rows: int = 0
    # drafts per row the multi-token-prediction head proposes (--speculative-method mtp); 0 = the head, if the
    # checkpoint has one, is not run and has no KV (gpu_worker.runner.mtp)
    mtp_draft_tokens: int = 0
    # tokens of a verify row (1 + --num-speculative-tokens; the engine sets it); with compile_step_sizes, the
    # verify steps of up to num_draft_rows / (verify_tokens - 1) rows get compiled programs too (compiled_step)
    verify_tokens: int = 0

    @property
    def buckets(self) -> tuple[int, ...]:
        """compile_step_sizes parsed (compiled_step.parse_buckets): the compiled decode steps' batch sizes."""
        from gpu_worker.model.backends.cpu.compiled_step import parse_buckets

        return parse_buckets(self.compile_step_sizes, self.max_num_seqs)

    def __post_init__(self) -> None:
        positive = ("kv_page_size_tokens", "max_num_seqs", "cuda_graph_max_context_tokens", "max_num_batched_tokens")
        for name in positive:
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("memory_budget_bytes", "checkpoint_memory_bytes"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidArgumentError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        names = (
            "cpu_threads", "cpu_prefill_threads", "cpu_decode_threads", "model_process_min_rows", "model_processes",
            "cpu_warm_rows", "model_process_lone_threads", "num_draft_rows", "mtp_draft_tokens", "verify_tokens",
        )  # fmt: skip
        for name in names:
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0 (0 = auto), got {getattr(self, name)}")
        if self.model_process_split_min_tokens < 0:
            raise InvalidArgumentError(
                f"model_process_split_min_tokens must be >= 0, got {self.model_process_split_min_tokens}"
            )
        if self.cpu_prefill_min_tokens <= 0:
            raise InvalidArgumentError(f"cpu_prefill_min_tokens must be positive, got {self.cpu_prefill_min_tokens}")
        if self.num_checkpoint_slots < 0:
            raise InvalidArgumentError(f"num_checkpoint_slots must be >= 0, got {self.num_checkpoint_slots}")
        if self.cpu_prefill_scan not in PREFILL_SCANS:
            raise InvalidArgumentError(
                f"cpu_prefill_scan must be one of {', '.join(PREFILL_SCANS)}, got {self.cpu_prefill_scan!r}"
            )
        if self.cpu_small_projections not in SMALL_PROJECTIONS:
            raise InvalidArgumentError(
                f"cpu_small_projections must be one of {', '.join(SMALL_PROJECTIONS)},"
                f" got {self.cpu_small_projections!r}"
            )
        if self.decode_compile not in DECODE_COMPILE_MODES:
            raise InvalidArgumentError(
                f"decode_compile must be one of {', '.join(DECODE_COMPILE_MODES)}, got {self.decode_compile!r}"
            )
        _ = self.buckets  # raises on a malformed list
        if self.model_process not in DECODE_COMPILE_MODES:
            raise InvalidArgumentError(
                f"model_process must be one of {', '.join(DECODE_COMPILE_MODES)}, got {self.model_process!r}"
            )
        if self.cuda_graph_max_batch < 0:
            raise InvalidArgumentError(f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")
