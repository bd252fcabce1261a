"""`hybridserve worker`: loads a model, runs the engine, serves the Generation API."""

from __future__ import annotations

import argparse
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from gpu_worker.api import lifecycle
from gpu_worker.api.service import GenerationServicer, add_to_server, server_threads
from gpu_worker.cache.manager import PrefixCacheManager
from gpu_worker.cache.remote import SharedTier, SharedTierAccess
from gpu_worker.engine.admission import max_model_len_limit
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.settings import EngineSettings, draft_rows_for, speculative_rows
from gpu_worker.observers.settings import ObserverSettings, observers_from_settings
from gpu_worker.runner.checkpoint_io import MIN_KEY_BYTES
from gpu_worker.runner.memory import check_host_memory
from gpu_worker.runner.model_process import build_runner
from gpu_worker.runner.profile import host_memory_bytes
from gpu_worker.runner.protocol import Runner
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.step_split import prefill_chunk_cap
from gpu_worker.runner.tuning import freeze_startup_objects, keep_freed_memory
from hybridserve import grpc_server
from hybridserve.auth import load_keys, load_secret
from hybridserve.errors import InvalidArgumentError
from hybridserve.metrics import METRICS_COMPAT_HELP
from hybridserve.model_files import read_model_files
from hybridserve.model_source import DOWNLOAD_DIR_HELP, MODEL_HELP, REVISION_HELP, resolve_model
from hybridserve.service_telemetry import METRICS_PORT_HELP, start_service_telemetry
from hybridserve.settings import (
    API_KEYS_ENV,
    CHECKPOINT_KEY_ENV,
    CLUSTER_TOKEN_ENV,
    Flag,
    add_settings_arguments,
    secret_from_env,
)
from hybridserve.settings import settings_from_args as settings_from_args_of
from hybridserve.tls import TlsSettings, add_tls_arguments
from scheduler_svc.client import SchedulerClient
from scheduler_svc.flags import add_config_arguments, chunk_cap_is_auto, config_from_args

log = logging.getLogger("hybridserve.worker")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WorkerServerSettings:
    """`hybridserve worker`'s own settings; with EngineSettings, RunnerConfig and SchedulerConfig, its
    flags (or HYBRIDSERVE_WORKER_* variables)."""

    model: str | None = None  # a checkpoint folder or a Hugging Face repo id (hybridserve.model_source)
    revision: str | None = None  # with a repo id: branch, tag or commit (None: main)
    download_dir: Path | None = None  # with a repo id: the hub cache folder (None: huggingface_hub's default)
    host: str = "127.0.0.1"  # bind address
    port: int = 50052  # 0 picks a free port
    prefix_caching: bool = True  # reuse cached prefixes (KV + Mamba state at block boundaries)
    metrics_port: int = -1  # Prometheus /metrics: -1 = off, 0 = a free port
    metrics_compat: str = ""  # "vllm": vLLM's series also under their vllm: names
    record_steps: Path | None = None  # JSONL file of sampled steps' scheduler input and plan
    record_sample_rate: float = 1.0  # fraction of steps recorded
    api_key_file: Path | None = None  # accepted API keys, one per line (or API_KEYS_ENV); none = open
    checkpoint_key_file: Path | None = None  # the workers' checkpoint MAC key (or CHECKPOINT_KEY_ENV)
    cluster_token_file: Path | None = None  # the cache service's cluster token (or CLUSTER_TOKEN_ENV)
    drain_timeout_s: float = 30.0  # on SIGTERM: how long requests in flight may run before they are cut
    serve_while_warming: bool = False  # ready once loaded; the compile and kernel builds go on in the background


FLAGS = {
    "model": Flag(MODEL_HELP + "; see `hybridserve init-model`", metavar="DIR|ORG/NAME"),
    "revision": Flag(REVISION_HELP),
    "download_dir": Flag(DOWNLOAD_DIR_HELP, metavar="DIR"),
    "host": Flag("bind address"),
    "port": Flag("0 picks a free port"),
    "scheduler_addresses": Flag("scheduler address(es), comma separated: host:port[,host:port]", name="--scheduler"),
    "cache_address": Flag("cache service host:port", name="--cache"),
    "async_scheduling": Flag("plan step N+1 while step N runs"),
    "max_queue_len": Flag("waiting requests at most; more get RESOURCE_EXHAUSTED"),
    "default_max_tokens": Flag("max_tokens of a request that leaves it unset"),
    "max_model_len": Flag(
        "prompt + max_tokens limit; 0 = the checkpoint's max_position_embeddings, capped by what the KV pool holds"
        " (a value above what the pool holds is refused at start-up)"
    ),
    "scheduler_deadline_s": Flag("seconds one PlanStep call may take"),
    "num_speculative_tokens": Flag(
        "speculative decoding: draft tokens a decode verifies per step at most (the output stays that of plain"
        " decoding; a request whose drafts all miss backs off); 0 = off"
    ),
    "speculative_method": Flag(
        "where drafts come from: ngram (prompt lookup in the request's own tokens) | mtp (the checkpoint's"
        " multi-token-prediction layers: Nemotron-H's mtp.*)"
    ),
    "ngram_min": Flag("prompt lookup: the shortest suffix of the request's tokens whose earlier occurrence drafts"),
    "ngram_max": Flag("prompt lookup: the longest suffix tried"),
    "speculative_max_rows": Flag(
        "drafts only in steps of at most this many running requests (a larger batch is cheap per token already);"
        " the runner keeps a state per draft token of each; 0 = auto: 8 where verify steps are compiled"
        " (--compile-step-sizes, prompt lookup), else 4"
    ),
    "speculative_payoff": Flag(
        "measure whether drafting pays (the tokens a drafted row gets accepted against the break-even of the"
        " step's rows and drafted rows) and stop drafting where it does not (retried after 16, 32, ... 1024"
        " steps); --no-speculative-payoff drafts whenever there are drafts"
    ),
    "scheduler_give_up_s": Flag("fail in-flight requests when no scheduler answers for this long"),
    "prefix_caching": Flag("reuse cached prefixes (KV + Mamba state at block boundaries)"),
    "memory_budget_bytes": Flag(
        "KV pages + Mamba state slots + checkpoints, MiB; 0 = auto: on CUDA --gpu-memory-utilization of the"
        " device, on CPU 256; when set it wins over --gpu-memory-utilization",
        name="--memory-budget-mb",
        scale=1 << 20,
    ),
    "gpu_memory_utilization": Flag(
        "on CUDA, the fraction of the device's memory this worker may use: less the weights and the activation"
        " budget (a profiled worst-case step), the rest goes to KV pages, state slots and checkpoints"
    ),
    "num_checkpoint_slots": Flag("Mamba state checkpoints kept on the worker (one per cached block)"),
    "checkpoint_memory_bytes": Flag(
        "memory for Mamba state checkpoints, MiB; when set, replaces --num-checkpoint-slots (LRU within it)",
        name="--checkpoint-memory-mb",
        scale=1 << 20,
    ),
    "device": Flag("auto | cpu | cuda[:i]"),
    "dtype": Flag("auto | float32 | bfloat16"),
    "cpu_threads": Flag("torch intra-op threads on CPU; 0 = one per core but one (for the server threads)"),
    "cpu_decode_threads": Flag(
        "torch intra-op threads on CPU for steps without prompt tokens (decode, verify); 0 = auto: every core"
        " for a model of 128 MiB of weights or more (with model processes, while the others are idle), else"
        " --cpu-threads"
    ),
    "cpu_prefill_threads": Flag(
        "torch intra-op threads on CPU for steps of at least --cpu-prefill-min-tokens tokens (prefill-sized"
        " GEMMs split well; e.g. every core for long-prompt workloads); 0 = --cpu-threads throughout"
    ),
    "cpu_prefill_min_tokens": Flag("tokens in a step from which it runs on --cpu-prefill-threads"),
    "cpu_prefill_scan": Flag(
        "the prefill's SSD scan on CPU: sequential (the plain recurrence in a C kernel built at start-up; chunked"
        " where no C compiler is found) | chunked (chunked GEMMs)"
    ),
    "cpu_small_projections": Flag(
        "float32 projections of under 2 MB of weight at up to 32 rows on CPU: mkl (torch's F.linear, MKL's"
        " sgemm) | onednn (oneDNN on prepacked weights) | auto (mkl on Intel cores, where MKL runs AVX-512)"
    ),
    "decode_compile": Flag(
        "torch.compile the Mamba decode step on CPU at start-up (readiness waits for it unless"
        " --serve-while-warming): auto (when a C++ compiler is found) | on | off"
    ),
    "compile_step_sizes": Flag(
        "on CPU, compile whole decode steps (embedding to logits, every layer) for these batch sizes at start-up,"
        " one program each; a step of n rows runs in the smallest size >= n, others eagerly: auto (1,2,4,8,16,32"
        " up to --max-num-seqs, where a C++ compiler is found) | off | comma-separated sizes"
    ),
    "model_process": Flag(
        "run the model in a process of its own beside the worker, the pools in memory both map (the forward"
        " then never waits for the worker's threads): auto (on CPU) | on | off"
    ),
    "model_process_min_rows": Flag(
        "with a model process, steps of fewer rows than this run in the worker's own process, eagerly (the"
        " worker then keeps its references to the weights); 0 = every step in the model process (the default)"
    ),
    "model_processes": Flag(
        "model processes sharing each step on as many cores (the decode rows stay together in the first; prefill"
        " chunks are dealt to whichever would finish first, by how fast each went); 0 = auto: two on a CPU with"
        " at least two usable cores, else one"
    ),
    "model_process_split_min_tokens": Flag(
        "with several model processes, steps of at least this many tokens (a decode row counting 2.5) are shared"
    ),
    "model_process_lone_threads": Flag(
        "with several model processes, a process runs its step on this many threads while the others are idle:"
        " from the start when it has the whole step (at least 64 prefill tokens), or once they finished their"
        " parts (at least 512); decode rows stay on one thread; 0 = auto: the processes' threads together, or"
        " the cores but one where that is more; 1 = off"
    ),
    "cpu_warm_rows": Flag(
        "on CPU, build oneDNN's projection kernels for every 16-row bucket up to this many rows at start-up"
        " (readiness waits for it unless --serve-while-warming; a first call with a new row count costs"
        " ~10-20 ms a forward); 0 = off"
    ),
    "metrics_port": Flag(METRICS_PORT_HELP),
    "metrics_compat": Flag(METRICS_COMPAT_HELP, metavar="vllm"),
    "record_steps": Flag(
        "append each sampled step's scheduler input and plan to this JSONL file (see `hybridserve replay`)",
        metavar="FILE",
    ),
    "record_sample_rate": Flag("fraction of steps recorded (1.0 = every step)"),
    "api_key_file": Flag(f"accepted API keys, one per line (or {API_KEYS_ENV}, comma separated)", metavar="FILE"),
    "checkpoint_key_file": Flag(
        f"the key sealing shared-tier checkpoints, the same on every worker (or {CHECKPOINT_KEY_ENV})", metavar="FILE"
    ),
    "cluster_token_file": Flag(f"the cache service's cluster token (or {CLUSTER_TOKEN_ENV})", metavar="FILE"),
    "serve_while_warming": Flag(
        "report ready as soon as the model is loaded and warm up in the background (the first requests decode"
        " eagerly and pay for their kernels); by default readiness waits for the decode compile, the kernel"
        " builds and a few warm-up steps, each timed in the log and in GetInfo"
    ),
    "drain_timeout_s": Flag(
        "on SIGTERM: stop admitting, let requests in flight finish for up to this long, then end the rest"
        " (UNAVAILABLE); give the process this plus 10 s before SIGKILL"
    ),
}
SECURITY_FIELDS = ("api_key_file", "checkpoint_key_file", "cluster_token_file")
ENGINE_FIELDS = (
    "scheduler_addresses", "cache_address", "async_scheduling", "max_queue_len", "default_max_tokens",
    "max_model_len", "scheduler_deadline_s", "scheduler_give_up_s", "num_speculative_tokens", "speculative_method",
    "ngram_min", "ngram_max", "speculative_max_rows", "speculative_payoff",
)  # fmt: skip
RUNNER_FIELDS = (
    "memory_budget_bytes", "gpu_memory_utilization", "num_checkpoint_slots", "checkpoint_memory_bytes", "device",
    "dtype", "cpu_threads", "cpu_decode_threads", "cpu_prefill_threads", "cpu_prefill_min_tokens", "cpu_prefill_scan",
    "cpu_small_projections", "decode_compile", "compile_step_sizes", "model_process",
    "model_process_min_rows", "model_processes", "model_process_split_min_tokens", "model_process_lone_threads",
    "cpu_warm_rows",
)  # fmt: skip  # the rest follow the config
OBSERVABILITY_FIELDS = ("metrics_port", "metrics_compat", "record_steps", "record_sample_rate")
SERVICE = "WORKER"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(
        parser, WorkerServerSettings, SERVICE, flags=FLAGS, exclude=OBSERVABILITY_FIELDS + SECURITY_FIELDS
    )
    add_config_arguments(parser, SERVICE)
    group = parser.add_argument_group("engine")
    add_settings_arguments(
        group, EngineSettings, SERVICE, flags=FLAGS, only=ENGINE_FIELDS,
        defaults={"scheduler_addresses": ("127.0.0.1:50051",)},
    )  # fmt: skip
    group = parser.add_argument_group("model runner")
    add_settings_arguments(
        group,
        RunnerConfig,
        SERVICE,
        flags=FLAGS,
        only=RUNNER_FIELDS,
        defaults={
            "decode_compile": "auto",
            "compile_step_sizes": "auto",
            "model_process": "auto",
            "cpu_warm_rows": 1024,
        },
    )  # a served worker compiles, and runs its model apart, when it can; a runner built in-process does not
    group = parser.add_argument_group("observability (tracing: the standard OTEL_* variables)")
    add_settings_arguments(group, WorkerServerSettings, SERVICE, flags=FLAGS, only=OBSERVABILITY_FIELDS)
    group = parser.add_argument_group("security (secrets: files or variables, never flags)")
    add_settings_arguments(group, WorkerServerSettings, SERVICE, flags=FLAGS, only=SECURITY_FIELDS)
    add_tls_arguments(group, SERVICE)


def observer_settings(server_settings: WorkerServerSettings) -> ObserverSettings:
    """The observers' settings from the worker's (the metrics port starts the endpoint)."""
    return ObserverSettings(
        record_steps=server_settings.record_steps,
        record_sample_rate=server_settings.record_sample_rate,
        metrics_compat=server_settings.metrics_compat,
    )


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    # Chunks keep the state at every block boundary they cross (gpu_worker/model/boundary_states.py),
    # so the planner need not stop a prompt's last chunk at its last boundary.
    scheduler = config_from_args(args, stop_at_last_boundary=False)
    buckets = RunnerConfig(max_num_seqs=scheduler.max_num_seqs, compile_step_sizes=args.compile_step_sizes).buckets
    rows = speculative_rows(args.speculative_max_rows, args.speculative_method, buckets)
    runner = settings_from_args_of(
        RunnerConfig, args, kv_page_size_tokens=scheduler.kv_page_size, max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        num_draft_rows=draft_rows_for(args.num_speculative_tokens, rows),
        mtp_draft_tokens=args.num_speculative_tokens if args.speculative_method == "mtp" else 0,
        verify_tokens=1 + args.num_speculative_tokens if args.num_speculative_tokens else 0,
    )  # fmt: skip
    return settings_from_args_of(EngineSettings, args, scheduler=scheduler, runner=runner, speculative_max_rows=rows)


def with_chunk_cap(settings: EngineSettings, args: argparse.Namespace, runner: Any) -> EngineSettings:
    """The settings with --long-prefill-token-threshold resolved when left on auto: capped so that the
    model processes share a step's prefill (gpu_worker.runner.step_split.prefill_chunk_cap), else none."""
    if not chunk_cap_is_auto(args):
        return settings
    processes = int(runner.describe().get("model_processes", 1))  # a ModelRunner's names none: one
    cap = prefill_chunk_cap(settings.scheduler, processes)
    if cap:
        log.info("prefill chunks capped at %d tokens: a step's prefill shared by %d model processes", cap, processes)
    return replace(settings, scheduler=replace(settings.scheduler, long_prefill_token_threshold=cap).validate())


def build_prefix_cache(
    runner: Runner, settings: EngineSettings, enabled: bool, access: SharedTierAccess | None = None
) -> PrefixCacheManager | None:
    """The local tier, plus the shared tier when --cache is given; None when caching is off or there
    are no checkpoint slots. Any mamba_cache_mode works: chunks keep the state at every block
    boundary they cross, so no chunk has to end on the grid. Without `access` checkpoints are
    sealed with a random key of this process alone."""
    if not enabled or runner.pools.state_pool.num_checkpoint_slots == 0:
        return None
    shared = None
    if settings.cache_address:
        access = access or SharedTierAccess(secrets.token_bytes(32))
        block_size = settings.scheduler.block_size
        layout = runner.pools.checkpoint_layout(block_size)
        shared = SharedTier(settings.cache_address, runner.loaded.fingerprint, block_size, layout, access)
    return PrefixCacheManager(runner.pools, runner.loaded.fingerprint, settings.scheduler.block_size, shared)


def shared_tier_access(server: WorkerServerSettings, tls: TlsSettings) -> SharedTierAccess:
    """The checkpoint key, cluster token and TLS for the shared tier. Without a configured key the
    worker seals with a random key of its own (warned): no other worker can use its checkpoints."""
    try:
        key = load_secret(server.checkpoint_key_file, secret_from_env(CHECKPOINT_KEY_ENV))
    except OSError as exc:
        raise SystemExit(f"worker secrets: {exc}") from None
    if key is not None and len(key.encode()) < MIN_KEY_BYTES:
        raise SystemExit(f"the checkpoint key must be at least {MIN_KEY_BYTES} bytes")
    if key is None:
        log.warning(
            "no checkpoint key (%s or --checkpoint-key-file): this worker seals shared-tier checkpoints "
            "with a random key of its own, so no other worker can use them", CHECKPOINT_KEY_ENV,
        )  # fmt: skip
    return SharedTierAccess(key.encode() if key else secrets.token_bytes(32), cluster_token(server), tls)


def cluster_token(server: WorkerServerSettings) -> str | None:
    """The cluster token this worker sends to the scheduler and the cache service (the first of a rotating
    "new,old" list); None without one."""
    try:
        token = load_secret(server.cluster_token_file, secret_from_env(CLUSTER_TOKEN_ENV))
    except OSError as exc:
        raise SystemExit(f"worker secrets: {exc}") from None
    return token.split(",")[0].strip() or None if token else None


def api_keys(server: WorkerServerSettings) -> frozenset[str]:
    try:
        return load_keys(server.api_key_file, secret_from_env(API_KEYS_ENV))
    except OSError as exc:
        raise SystemExit(f"--api-key-file: {exc}") from None


def refuse_on_invalid(build: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`build(*args, **kwargs)`; a setting that cannot be served (InvalidArgumentError: the memory does not
    fit, an impossible --max-model-len) ends the start-up with its one-line message instead of a traceback."""
    try:
        return build(*args, **kwargs)
    except InvalidArgumentError as exc:
        raise SystemExit(f"worker: {exc}") from None


def engine_alive(engine: Engine) -> bool:
    """Liveness: the engine's loop still runs."""
    return engine.is_alive()


def run(args: argparse.Namespace) -> int:
    server_settings = settings_from_args_of(WorkerServerSettings, args)
    if server_settings.model is None:
        raise SystemExit("--model DIR|ORG/NAME is required (write the default model with `hybridserve init-model DIR`)")
    source = resolve_model(server_settings.model, server_settings.revision, server_settings.download_dir)
    settings = settings_from_args(args)
    tls = settings_from_args_of(TlsSettings, args)
    keys = api_keys(server_settings)
    keep_freed_memory()  # glibc: reuse freed activation memory instead of page-faulting it back each step
    stop_telemetry = start_service_telemetry("hybridserve-worker", server_settings.metrics_port, server_settings.host)
    observers = observers_from_settings(observer_settings(server_settings), model_name=source.served_name)
    runner = refuse_on_invalid(build_runner, source.path, settings.runner)
    log.info("model %s loaded from %s: %s", source.served_name, source.path, runner.describe())
    log.info("%s", runner.memory.describe())
    if runner.device.type == "cpu":  # weights, pools and each model process's activation budget fit the host
        processes = int(runner.describe().get("model_processes", 1))
        refuse_on_invalid(check_host_memory, runner.memory, processes, host_memory_bytes())
    settings = with_chunk_cap(settings, args, runner)
    client = SchedulerClient(
        settings.scheduler_addresses,
        deadline_s=settings.scheduler_deadline_s,
        give_up_after_s=settings.scheduler_give_up_s,
        tls=tls,
        token=cluster_token(server_settings),
    )
    access = shared_tier_access(server_settings, tls) if settings.cache_address else None
    prefix = build_prefix_cache(runner, settings, server_settings.prefix_caching, access)
    model_len = refuse_on_invalid(max_model_len_limit, runner, settings)  # an impossible --max-model-len ends here
    log.info("max_model_len %d: %s", model_len.tokens, model_len.source)
    warmup = lifecycle.Warmup(runner, server_settings.serve_while_warming)
    engine = Engine(
        runner, client.plan, settings, observer=observers if observers.is_active else None, prefix=prefix,
        warm_up=warmup.hook,
    )  # fmt: skip
    freeze_startup_objects()  # full collections skip the model's and the libraries' objects
    model_files = refuse_on_invalid(read_model_files, source.path)  # what a gateway without --model fetches
    servicer = GenerationServicer(engine, model_name=source.served_name, warmup=warmup, model_files=model_files)
    server, port, health = grpc_server.create_server(
        [add_to_server(servicer)], host=server_settings.host, port=server_settings.port,
        max_workers=server_threads(engine), tls=tls, keys=keys,  # a stream holds a thread to its end
    )  # fmt: skip
    engine.start()  # warms up first: liveness SERVING, readiness NOT_SERVING until it is done
    watch = lifecycle.HealthWatch(health, engine, servicer, client.is_reachable, warmup)
    stop = grpc_server.stop_on_signal()  # before the port is announced
    server.start()
    grpc_server.announce(server_settings.host, port)
    grpc_server.wait_for(stop)
    lifecycle.drain(server, health, servicer, engine, server_settings.drain_timeout_s, warmup=warmup)
    watch.stop()  # before the scheduler channel closes: no probe in flight
    client.close()
    observers.close()
    runner.close()  # the model processes
    stop_telemetry()
    return 0
