"""`hybridserve worker`: loads a model, runs the engine, serves the Generation API."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
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
from hybridserve.service_telemetry import METRICS_PORT_HELP, start_service_telemetry
from hybridserve.settings import Flag, add_settings_arguments
from hybridserve.settings import settings_from_args as settings_from_args_of
from scheduler_svc.client import SchedulerClient
from scheduler_svc.flags import add_config_arguments, config_from_args

log = logging.getLogger("hybridserve.worker")


@dataclass(frozen=True, slots=True)
class WorkerServerSettings:
    """`hybridserve worker`'s own settings; with EngineSettings, RunnerConfig and SchedulerConfig, its
    flags (or HYBRIDSERVE_WORKER_* variables)."""

    model: Path | None = None  # checkpoint folder (Hugging Face Bamba format)
    host: str = "127.0.0.1"  # bind address
    port: int = 50052  # 0 picks a free port
    prefix_caching: bool = True  # reuse cached prefixes (KV + Mamba state at block boundaries); ALIGN only
    metrics_port: int = -1  # Prometheus /metrics: -1 = off, 0 = a free port
    record_steps: Path | None = None  # JSONL file of sampled steps' scheduler input and plan
    record_sample_rate: float = 1.0  # fraction of steps recorded


FLAGS = {
    "model": Flag("checkpoint folder (Hugging Face Bamba format); see `hybridserve init-model`", metavar="DIR"),
    "host": Flag("bind address"),
    "port": Flag("0 picks a free port"),
    "scheduler_addresses": Flag("scheduler address(es), comma separated: host:port[,host:port]", name="--scheduler"),
    "cache_address": Flag("cache service host:port", name="--cache"),
    "async_scheduling": Flag("plan step N+1 while step N runs"),
    "max_queue_len": Flag("waiting requests at most; more get RESOURCE_EXHAUSTED"),
    "default_max_tokens": Flag("max_tokens of a request that leaves it at 0"),
    "max_model_len": Flag("prompt + max_tokens limit (0 = what the KV pool holds)"),
    "scheduler_deadline_s": Flag("seconds one PlanStep call may take"),
    "scheduler_give_up_s": Flag("fail in-flight requests when no scheduler answers for this long"),
    "prefix_caching": Flag("reuse cached prefixes (KV + Mamba state at block boundaries); ALIGN mode only"),
    "memory_budget_bytes": Flag(
        "KV pages + Mamba state slots + checkpoints, MiB", name="--memory-budget-mb", scale=1 << 20
    ),
    "num_checkpoint_slots": Flag("Mamba state checkpoints kept on the worker (one per cached block)"),
    "device": Flag("auto | cpu | cuda[:i]"),
    "dtype": Flag("auto | float32 | bfloat16"),
    "cpu_threads": Flag("torch intra-op threads on CPU; 0 = one per core but one (for the server threads)"),
    "metrics_port": Flag(METRICS_PORT_HELP),
    "record_steps": Flag(
        "append each sampled step's scheduler input and plan to this JSONL file (see `hybridserve replay`)",
        metavar="FILE",
    ),
    "record_sample_rate": Flag("fraction of steps recorded (1.0 = every step)"),
}
ENGINE_FIELDS = (
    "scheduler_addresses", "cache_address", "async_scheduling", "max_queue_len", "default_max_tokens",
    "max_model_len", "scheduler_deadline_s", "scheduler_give_up_s",
)  # fmt: skip
RUNNER_FIELDS = ("memory_budget_bytes", "num_checkpoint_slots", "device", "dtype", "cpu_threads")  # the rest: config
OBSERVABILITY_FIELDS = ("metrics_port", "record_steps", "record_sample_rate")
SERVICE = "WORKER"
# Threads beyond one per running stream, so health checks, GetInfo polls (the gateway's readiness)
# and Abort are answered while max_num_seqs streams run; with the default pool of 32, 32 streaming
# clients starved the gateway's polls and it took the worker out of rotation (HTTP 503s).
SPARE_RPC_THREADS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, WorkerServerSettings, SERVICE, flags=FLAGS, exclude=OBSERVABILITY_FIELDS)
    add_config_arguments(parser, SERVICE)
    group = parser.add_argument_group("engine")
    add_settings_arguments(
        group, EngineSettings, SERVICE, flags=FLAGS, only=ENGINE_FIELDS,
        defaults={"scheduler_addresses": ("127.0.0.1:50051",)},
    )  # fmt: skip
    group = parser.add_argument_group("model runner")
    add_settings_arguments(group, RunnerConfig, SERVICE, flags=FLAGS, only=RUNNER_FIELDS)
    group = parser.add_argument_group("observability (tracing: the standard OTEL_* variables)")
    add_settings_arguments(group, WorkerServerSettings, SERVICE, flags=FLAGS, only=OBSERVABILITY_FIELDS)


def observer_settings(server_settings: WorkerServerSettings) -> ObserverSettings:
    """The observers' settings from the worker's (the metrics port starts the endpoint)."""
    return ObserverSettings(
        record_steps=server_settings.record_steps, record_sample_rate=server_settings.record_sample_rate
    )


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    server = settings_from_args_of(WorkerServerSettings, args)
    scheduler = config_from_args(args, stop_at_last_boundary=server.prefix_caching)
    runner = settings_from_args_of(
        RunnerConfig, args, kv_page_size_tokens=scheduler.kv_page_size, max_num_seqs=scheduler.max_num_seqs
    )
    return settings_from_args_of(EngineSettings, args, scheduler=scheduler, runner=runner)


def build_prefix_cache(runner: ModelRunner, settings: EngineSettings, enabled: bool) -> PrefixCacheManager | None:
    """The local tier, plus the shared tier when --cache is given; None when caching is off or the
    scheduler does not align chunks to the checkpoint grid (no state would exist at block ends)."""
    if not enabled or not settings.scheduler.is_aligned or runner.state_pool.num_checkpoint_slots == 0:
        return None
    shared = None
    if settings.cache_address:
        shared = SharedTier(settings.cache_address, runner.loaded.fingerprint, settings.scheduler.block_size)
    return PrefixCacheManager(runner, settings.scheduler.block_size, shared)


def engine_alive(engine: Engine) -> bool:
    """Liveness: the engine's step thread still runs (the server is created once the model loaded,
    so readiness needs no probe of its own)."""
    is_alive = getattr(engine, "is_alive", None)
    if callable(is_alive):
        return bool(is_alive())
    thread = getattr(engine, "_thread", None)  # until Engine reports it itself
    return thread is None or bool(thread.is_alive())


def run(args: argparse.Namespace) -> int:
    server_settings = settings_from_args_of(WorkerServerSettings, args)
    if server_settings.model is None:
        raise SystemExit("--model DIR is required (write the default model with `hybridserve init-model DIR`)")
    settings = settings_from_args(args)
    keep_freed_memory()  # glibc: reuse freed activation memory instead of page-faulting it back each step
    stop_telemetry = start_service_telemetry("hybridserve-worker", server_settings.metrics_port, server_settings.host)
    observers = observers_from_settings(observer_settings(server_settings), model_name=Path(server_settings.model).name)
    runner = ModelRunner.from_model_dir(server_settings.model, settings.runner)
    log.info("model %s loaded: %s", server_settings.model, runner.describe())
    client = SchedulerClient(
        settings.scheduler_addresses,
        deadline_s=settings.scheduler_deadline_s,
        give_up_after_s=settings.scheduler_give_up_s,
    )
    prefix = build_prefix_cache(runner, settings, server_settings.prefix_caching)
    engine = Engine(runner, client.plan, settings, observer=observers if observers.is_active else None, prefix=prefix)
    engine.start()
    servicer = GenerationServicer(engine, model_name=server_settings.model.name)
    server, port, health = grpc_server.create_server(
        [add_to_server(servicer)], host=server_settings.host, port=server_settings.port,
        max_workers=settings.scheduler.max_num_seqs + SPARE_RPC_THREADS,  # a stream holds a thread to its end
    )  # fmt: skip
    stop_watching = grpc_server.watch_health(health, is_alive=lambda: engine_alive(engine))
    server.start()
    grpc_server.announce(server_settings.host, port)

    def stop() -> None:
        stop_watching.set()
        engine.stop()
        client.close()
        observers.close()
        stop_telemetry()

    grpc_server.serve_until_signal(server, health, on_stop=stop)
    return 0
