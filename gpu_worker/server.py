"""`hybridserve worker`: loads a model, runs the engine, serves the Generation API."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path

from gpu_worker.cache.manager import PrefixCacheManager
from gpu_worker.cache.remote import SharedTier
from gpu_worker.cpu_alloc import keep_freed_memory
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.observers.settings import ObserverSettings, observers_from_settings
from gpu_worker.runner import ModelRunner, RunnerConfig
from gpu_worker.service import GenerationServicer, add_to_server
from hybridserve import grpc_server
from hybridserve.cliutil import env_default
from hybridserve.service_telemetry import add_metrics_arguments, start_service_telemetry
from scheduler_svc.client import SchedulerClient
from scheduler_svc.flags import add_config_arguments, config_from_args

log = logging.getLogger("hybridserve.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        default=env_default("MODEL", None, Path),
        required=False,
        help="checkpoint folder (Hugging Face Bamba format); see `hybridserve init-model`",
    )
    parser.add_argument(
        "--scheduler",
        default=env_default("SCHEDULER", "127.0.0.1:50051"),
        help="scheduler address(es), comma separated: host:port[,host:port]",
    )
    parser.add_argument("--cache", default=env_default("CACHE", None), help="cache service host:port")
    parser.add_argument("--host", default=env_default("WORKER_HOST", "127.0.0.1"), help="bind address")
    parser.add_argument("--port", type=int, default=env_default("WORKER_PORT", 50052, int), help="0 = free port")
    add_config_arguments(parser)
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=env_default("ASYNC_SCHEDULING", True, _bool),
        help="plan step N+1 while step N runs (default on)",
    )
    group.add_argument("--max-queue-len", type=int, default=env_default("MAX_QUEUE_LEN", 1024, int))
    group.add_argument("--default-max-tokens", type=int, default=env_default("DEFAULT_MAX_TOKENS", 256, int))
    group.add_argument(
        "--max-model-len",
        type=int,
        default=env_default("MAX_MODEL_LEN", 0, int),
        help="prompt + max_tokens limit (0 = what the KV pool holds)",
    )
    group.add_argument("--scheduler-deadline-s", type=float, default=env_default("SCHEDULER_DEADLINE_S", 2.0, float))
    group.add_argument(
        "--scheduler-give-up-s",
        type=float,
        default=env_default("SCHEDULER_GIVE_UP_S", 30.0, float),
        help="fail in-flight requests when no scheduler answers for this long",
    )
    group.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=env_default("PREFIX_CACHING", True, _bool),
        help="reuse cached prefixes (KV + Mamba state at block boundaries); ALIGN mode only",
    )
    group = parser.add_argument_group("model runner")
    group.add_argument(
        "--memory-budget-mb",
        type=int,
        default=env_default("MEMORY_BUDGET_MB", 256, int),
        help="KV pages + Mamba state slots + checkpoints, MiB",
    )
    group.add_argument(
        "--num-checkpoint-slots",
        type=int,
        default=env_default("NUM_CHECKPOINT_SLOTS", 64, int),
        help="Mamba state checkpoints kept on the worker (one per cached block)",
    )
    group.add_argument("--device", default=env_default("DEVICE", "auto"), help="auto | cpu | cuda[:i]")
    group.add_argument("--dtype", default=env_default("DTYPE", "auto"), help="auto | float32 | bfloat16")
    add_observability_arguments(parser)


def add_observability_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's --metrics-port, --record-steps and --record-sample-rate."""
    group = parser.add_argument_group("observability (tracing: the standard OTEL_* variables)")
    add_metrics_arguments(group, "WORKER")
    group.add_argument(
        "--record-steps",
        type=Path,
        default=env_default("RECORD_STEPS", None, Path),
        help="append each sampled step's scheduler input and plan to this JSONL file (see `hybridserve replay`)",
    )
    group.add_argument(
        "--record-sample-rate",
        type=float,
        default=env_default("RECORD_SAMPLE_RATE", 1.0, float),
        help="fraction of steps recorded (1.0 = every step)",
    )


def observer_settings_from_args(args: argparse.Namespace) -> ObserverSettings:
    """The observers' settings from the flags above (the metrics port starts the endpoint)."""
    return ObserverSettings(record_steps=args.record_steps, record_sample_rate=args.record_sample_rate)


def _bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    scheduler = replace(config_from_args(args), prefix_caching=bool(args.prefix_caching))
    runner = RunnerConfig(
        memory_budget_bytes=args.memory_budget_mb << 20,
        kv_page_size_tokens=scheduler.kv_page_size,
        max_num_seqs=scheduler.max_num_seqs,
        num_checkpoint_slots=args.num_checkpoint_slots,
        device=args.device,
        dtype=args.dtype,
    )
    return EngineSettings(
        scheduler=scheduler,
        runner=runner,
        scheduler_addresses=tuple(a.strip() for a in args.scheduler.split(",") if a.strip()),
        cache_address=args.cache,
        async_scheduling=args.async_scheduling,
        max_queue_len=args.max_queue_len,
        default_max_tokens=args.default_max_tokens,
        max_model_len=args.max_model_len,
        scheduler_deadline_s=args.scheduler_deadline_s,
        scheduler_give_up_s=args.scheduler_give_up_s,
    )


def build_prefix_cache(runner: ModelRunner, settings: EngineSettings, enabled: bool) -> PrefixCacheManager | None:
    """The local tier, plus the shared tier when --cache is given; None when caching is off or the
    scheduler does not align chunks to the checkpoint grid (no state would exist at block ends)."""
    if not enabled or not settings.scheduler.is_aligned or runner.state_pool.num_checkpoint_slots == 0:
        return None
    shared = None
    if settings.cache_address:
        shared = SharedTier(settings.cache_address, runner.loaded.fingerprint, settings.scheduler.block_size)
    return PrefixCacheManager(runner, settings.scheduler.block_size, shared)


def run(args: argparse.Namespace) -> int:
    if args.model is None:
        raise SystemExit("--model DIR is required (write the default model with `hybridserve init-model DIR`)")
    settings = settings_from_args(args)
    keep_freed_memory()  # glibc: reuse freed activation memory instead of page-faulting it back each step
    stop_telemetry = start_service_telemetry("hybridserve-worker", args.metrics_port, args.host)
    observers = observers_from_settings(observer_settings_from_args(args), model_name=Path(args.model).name)
    runner = ModelRunner.from_model_dir(args.model, settings.runner)
    log.info("model %s loaded: %s", args.model, runner.describe())
    client = SchedulerClient(
        settings.scheduler_addresses,
        deadline_s=settings.scheduler_deadline_s,
        give_up_after_s=settings.scheduler_give_up_s,
    )
    prefix = build_prefix_cache(runner, settings, args.prefix_caching)
    engine = Engine(runner, client.plan, settings, observer=observers if observers.is_active else None, prefix=prefix)
    engine.start()
    servicer = GenerationServicer(engine, model_name=Path(args.model).name)
    server, port, health = grpc_server.create_server([add_to_server(servicer)], host=args.host, port=args.port)
    server.start()
    grpc_server.announce(args.host, port)

    def stop() -> None:
        engine.stop()
        client.close()
        observers.close()
        stop_telemetry()

    grpc_server.serve_until_signal(server, health, on_stop=stop)
    return 0
