"""`hybridserve gateway`: the OpenAI HTTP API and the proxied gRPC Generation API in front of workers.

    hybridserve gateway --workers HOST:PORT[,HOST:PORT...] [--port 8000] [--grpc-port 50050]
                        [--model DIR|ORG/NAME [--revision R]] [--api-key-file FILE] [--routing prefix|round-robin]

Without --model the tokenizer, chat template and generation defaults come from the workers
(gateway/model_files.py); /ready stays 503 until they have.

Prints `listening on HOST:PORT` (HTTP) first, then `grpc listening on HOST:PORT`. SIGTERM or Ctrl-C:
readiness turns NOT_SERVING, calls in flight get --grace-s to finish, then the process exits 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from gateway.affinity import PrefixTable
from gateway.chat_template import ChatTemplate, TemplateError, load_chat_template
from gateway.dispatch import Dispatcher, RoutingSettings
from gateway.grpc_proxy import GenerationProxy, create_grpc_server, watch_readiness
from gateway.http_app import Gateway, build_app
from gateway.metrics import GatewayMetrics
from gateway.model_files import LoadedFiles, adopt_worker_files
from gateway.pool import WorkerPool, split_host_port
from gateway.tokens import GatewayTokenizer
from hybridserve import telemetry
from hybridserve.auth import load_keys
from hybridserve.errors import InvalidArgumentError
from hybridserve.generation_config import GenerationDefaults, read_generation_config
from hybridserve.grpc_server import announce
from hybridserve.metrics import METRICS_COMPAT, METRICS_COMPAT_HELP
from hybridserve.model_source import DOWNLOAD_DIR_HELP, GATEWAY_FILES, MODEL_HELP, REVISION_HELP, resolve_model
from hybridserve.settings import (
    API_KEYS_ENV,
    Flag,
    add_settings_arguments,
    env_name,
    secret_from_env,
    settings_from_args,
)
from hybridserve.tls import TlsSettings, add_tls_arguments

log = logging.getLogger("hybridserve.gateway")

SERVICE = "GATEWAY"  # HYBRIDSERVE_GATEWAY_<FIELD>
# Threads rendering chat templates and tokenizing prompts, off the event loop; more requests wait their
# turn. Tokenizing a long text releases the GIL (gateway/tokens.py), so these use other cores.
TEXT_THREADS = 4


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """The gateway's flags, or HYBRIDSERVE_GATEWAY_<FIELD> variables (hybridserve/settings.py)."""

    workers: str = ""  # HOST:PORT[,HOST:PORT...]; a name may resolve to several workers (required)
    host: str = "127.0.0.1"  # bind address
    port: int = 8000  # HTTP; 0 = a free port
    grpc_port: int = 50050  # the proxied Generation API; 0 = a free port
    model: str | None = None  # the workers' model (folder or repo id): tokenizer.json and the chat template
    revision: str | None = None  # with a repo id: branch, tag or commit (None: main)
    download_dir: Path | None = None  # with a repo id: the hub cache folder (None: huggingface_hub's default)
    served_model_name: str = ""  # the name clients send; "" = the workers' model name
    chat_template: Path | None = None  # a Jinja template file overriding the model's
    api_key_file: Path | None = None  # accepted API keys, one per line
    routing: str = "prefix"  # "prefix" (affinity weighed against load) or "round-robin" (the baseline)
    request_cost_tokens: int = 64  # one active request on a worker, priced in uncached prompt tokens
    max_body_mb: float = 16.0  # largest request body, MiB
    request_timeout_s: float = 600.0  # longest a request may run
    poll_interval_s: float = 0.25  # worker health and load poll period
    grace_s: float = 5.0  # on SIGTERM, time for calls in flight
    metrics_compat: str = ""  # "vllm": vLLM's series also under their vllm: names


FLAGS = {
    "workers": Flag("worker addresses, comma separated; a name may resolve to several", metavar="HOST:PORT[,...]"),
    "host": Flag("bind address"),
    "port": Flag("HTTP; 0 = a free port"),
    "grpc_port": Flag("the proxied gRPC Generation API; 0 = a free port"),
    "model": Flag(
        "the workers' model, " + MODEL_HELP + ": its tokenizer (prefix routing, logprob tokens) and chat template"
        " (of an id, only those files are downloaded); without it they come from the workers (GetModelFiles)",
        metavar="DIR|ORG/NAME",
    ),
    "revision": Flag(REVISION_HELP),
    "download_dir": Flag(DOWNLOAD_DIR_HELP, metavar="DIR"),
    "served_model_name": Flag("the model name clients send (default: the workers' model name)"),
    "chat_template": Flag("a Jinja chat template file", metavar="FILE"),
    "api_key_file": Flag(f"accepted API keys, one per line (or {API_KEYS_ENV}, comma separated)", metavar="FILE"),
    "routing": Flag("prefix: affinity weighed against load; round-robin: the baseline"),
    "request_cost_tokens": Flag("routing: one active request weighs as much as this many uncached prompt tokens"),
    "max_body_mb": Flag("largest request body, MiB"),
    "request_timeout_s": Flag("longest a request may run"),
    "poll_interval_s": Flag("worker health and load poll period"),
    "grace_s": Flag("on SIGTERM, time for calls in flight"),
    "metrics_compat": Flag(METRICS_COMPAT_HELP, metavar="vllm"),
}


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway runs on, built once at start-up from its settings and secrets."""

    workers: tuple[str, ...]  # HOST:PORT each; a name may resolve to several workers
    host: str
    port: int  # HTTP; 0 = a free port
    grpc_port: int  # the proxied Generation API; 0 = a free port
    model_dir: Path | None  # tokenizer.json and the chat template
    served_model_name: str  # "" = the workers' model name
    chat_template: Path | None  # overrides the model's template
    api_keys: frozenset[str]
    worker_api_key: str  # sent to the workers when they require a key
    routing: RoutingSettings
    max_body_bytes: int
    request_timeout_s: float
    poll_interval_s: float
    grace_s: float
    tls: TlsSettings  # the gRPC port's certificate (mTLS with a client CA), and how to dial the workers
    metrics_compat: str = ""  # "vllm": /metrics also under vLLM's names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, GatewaySettings, SERVICE, flags=FLAGS)
    add_tls_arguments(parser, SERVICE)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    settings = settings_from_args(GatewaySettings, args)
    workers = tuple(a.strip() for a in settings.workers.split(",") if a.strip())
    if not workers:
        raise SystemExit(f"--workers HOST:PORT[,HOST:PORT] is required (or {env_name(SERVICE, 'workers')})")
    try:
        for address in workers:
            split_host_port(address)
    except ValueError as exc:
        raise SystemExit(f"--workers: {exc}") from None
    if settings.metrics_compat not in METRICS_COMPAT:
        raise SystemExit(f"--metrics-compat {settings.metrics_compat!r}: use vllm (or leave it out)")
    if settings.routing not in ("prefix", "round-robin"):
        raise SystemExit(f"--routing {settings.routing!r}: use prefix or round-robin")
    if settings.request_cost_tokens < 0 or settings.max_body_mb <= 0 or settings.poll_interval_s <= 0:
        raise SystemExit("--request-cost-tokens must be >= 0; --max-body-mb and --poll-interval-s > 0")
    try:
        keys = load_keys(settings.api_key_file, secret_from_env(API_KEYS_ENV))
    except OSError as exc:
        raise SystemExit(f"--api-key-file: {exc}") from None
    model_dir = None
    if settings.model is not None:
        model_dir = resolve_model(settings.model, settings.revision, settings.download_dir, GATEWAY_FILES).path
    return GatewayConfig(
        workers=workers,
        host=settings.host,
        port=settings.port,
        grpc_port=settings.grpc_port,
        model_dir=model_dir,
        served_model_name=settings.served_model_name,
        chat_template=settings.chat_template,
        api_keys=keys,
        worker_api_key=secret_from_env(env_name(SERVICE, "worker_api_key")) or "",
        routing=RoutingSettings(settings.routing, settings.request_cost_tokens),
        max_body_bytes=int(settings.max_body_mb * (1 << 20)),
        request_timeout_s=settings.request_timeout_s,
        poll_interval_s=settings.poll_interval_s,
        grace_s=settings.grace_s,
        tls=settings_from_args(TlsSettings, args),
        metrics_compat=settings.metrics_compat,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:
        template = load_chat_template(config.model_dir, config.chat_template)
    except (TemplateError, OSError) as exc:
        raise SystemExit(f"chat template: {exc}") from None
    if config.model_dir is None:
        log.info("no --model: the tokenizer, chat template and generation defaults come from the workers")
    elif template is None:
        log.warning("the model has no chat template (give --chat-template FILE): /v1/chat/completions answers 400")
    try:
        tokenizer = GatewayTokenizer.from_model_dir(config.model_dir)
        defaults = read_generation_config(config.model_dir)
    except InvalidArgumentError as exc:
        raise SystemExit(f"--model: {exc}") from None
    stop_tracing = telemetry.setup_tracing("hybridserve-gateway")
    try:
        asyncio.run(serve(config, template, tokenizer, defaults))
    finally:
        stop_tracing()
    return 0


async def serve(
    config: GatewayConfig,
    template: ChatTemplate | None,
    tokenizer: GatewayTokenizer | None,
    defaults: GenerationDefaults,
) -> None:
    metrics = GatewayMetrics(compat=config.metrics_compat)
    table = PrefixTable()
    metadata = (("authorization", f"Bearer {config.worker_api_key}"),) if config.worker_api_key else ()
    pool = WorkerPool(
        config.workers, poll_interval_s=config.poll_interval_s, metadata=metadata, on_down=table.forget, tls=config.tls,
        files_hash=None if config.model_dir is not None else "",  # without --model: the workers' files, once adopted
    )  # fmt: skip
    await pool.start()
    dispatcher = Dispatcher(pool, table, config.routing, metrics)
    text_work = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="text")
    gateway = Gateway(
        dispatcher,
        metrics,
        config.api_keys,
        config.served_model_name,
        tokenizer,
        template,
        config.request_timeout_s,
        defaults,
        text_work,
        files_source="--model" if config.model_dir is not None else "",
    )
    runner = web.AppRunner(build_app(gateway, config.max_body_bytes), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_port=False)
    await site.start()
    http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    announce(config.host, http_port)
    proxy = GenerationProxy(dispatcher, metrics, config.api_keys, tokenizer, config.request_timeout_s, text_work)
    grpc_server, grpc_port, health_servicer = create_grpc_server(proxy, config.host, config.grpc_port, config.tls)
    await grpc_server.start()
    announce(config.host, grpc_port, "grpc")

    def on_loaded(loaded: LoadedFiles) -> None:
        gateway.tokenizer = proxy.tokenizer = loaded.tokenizer
        gateway.chat_template = loaded.template
        gateway.generation_defaults = loaded.defaults
        gateway.files_source = "workers"

    adopting = None
    if config.model_dir is None:
        adopting = asyncio.create_task(adopt_worker_files(pool, on_loaded, config.chat_template))
    log.info("routing %s over %s", config.routing.mode, ", ".join(config.workers))
    readiness = asyncio.create_task(watch_readiness(dispatcher, health_servicer, config.poll_interval_s))
    await _until_signal()
    log.info("shutting down")
    readiness.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await readiness
    if adopting is not None:
        adopting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await adopting
    await health_servicer.enter_graceful_shutdown()
    await grpc_server.stop(config.grace_s)
    await runner.cleanup()
    gateway.bodies.close()
    text_work.shutdown(wait=False, cancel_futures=True)
    await pool.close()
    log.info("stopped")


async def _until_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
