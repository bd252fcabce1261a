"""`hybridserve gateway`: the OpenAI HTTP API and the proxied gRPC Generation API in front of workers.

    hybridserve gateway --workers HOST:PORT[,HOST:PORT...] [--port 8000] [--grpc-port 50050]
                        [--model DIR] [--api-key-file FILE] [--routing prefix|round-robin]

Prints `listening on HOST:PORT` (HTTP) first, then `grpc listening on HOST:PORT`. SIGTERM or Ctrl-C:
readiness turns NOT_SERVING, calls in flight get --grace-s to finish, then the process exits 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from gateway.affinity import PrefixTable
from gateway.auth import load_keys
from gateway.chat_template import ChatTemplate, TemplateError, load_chat_template
from gateway.dispatch import Dispatcher, RoutingSettings
from gateway.grpc_proxy import GenerationProxy, create_grpc_server, watch_readiness
from gateway.http_app import Gateway, build_app
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool, split_host_port
from gateway.tokens import GatewayTokenizer
from hybridserve import telemetry
from hybridserve.cliutil import env_default

log = logging.getLogger("hybridserve.gateway")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway reads from flags and the environment, once, at start-up."""

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers",
        default=env_default("GATEWAY_WORKERS", None),
        help="worker addresses, comma separated: HOST:PORT[,HOST:PORT]; a name may resolve to several"
        " (env HYBRIDSERVE_GATEWAY_WORKERS)",
    )
    parser.add_argument("--host", default=env_default("GATEWAY_HOST", "127.0.0.1"), help="bind address")
    parser.add_argument("--port", type=int, default=env_default("GATEWAY_PORT", 8000, int), help="HTTP; 0 = free port")
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=env_default("GATEWAY_GRPC_PORT", 50050, int),
        help="the proxied gRPC Generation API; 0 = free port",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=env_default("MODEL", None, Path),
        help="the workers' model folder: its tokenizer (prefix routing on token blocks, logprob"
        " tokens) and chat template",
    )
    parser.add_argument(
        "--served-model-name",
        default=env_default("SERVED_MODEL_NAME", ""),
        help="the model name clients send (default: the workers' model name)",
    )
    parser.add_argument("--chat-template", type=Path, default=None, help="a Jinja chat template file")
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=env_default("API_KEY_FILE", None, Path),
        help="accepted API keys, one per line (or env HYBRIDSERVE_API_KEYS, comma separated)",
    )
    parser.add_argument(
        "--routing",
        choices=("prefix", "round-robin"),
        default=env_default("GATEWAY_ROUTING", "prefix"),
        help="prefix: affinity weighed against load (default); round-robin: the baseline",
    )
    parser.add_argument(
        "--request-cost-tokens",
        type=int,
        default=64,
        help="routing: one active request on a worker weighs as much as this many uncached prompt tokens",
    )
    parser.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body, MiB")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="longest a request may run")
    parser.add_argument("--poll-interval-s", type=float, default=0.25, help="worker health and load poll period")
    parser.add_argument("--grace-s", type=float, default=5.0, help="on SIGTERM, time for calls in flight")


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    if not args.workers:
        raise SystemExit("--workers HOST:PORT[,HOST:PORT] is required (or HYBRIDSERVE_GATEWAY_WORKERS)")
    workers = tuple(a.strip() for a in args.workers.split(",") if a.strip())
    try:
        for address in workers:
            split_host_port(address)
    except ValueError as exc:
        raise SystemExit(f"--workers: {exc}") from None
    if args.request_cost_tokens < 0 or args.max_body_mb <= 0 or args.poll_interval_s <= 0:
        raise SystemExit("--request-cost-tokens must be >= 0; --max-body-mb and --poll-interval-s > 0")
    try:
        keys = load_keys(args.api_key_file, env_default("API_KEYS", None))
    except OSError as exc:
        raise SystemExit(f"--api-key-file: {exc}") from None
    return GatewayConfig(
        workers=workers,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        model_dir=args.model,
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        api_keys=keys,
        worker_api_key=env_default("WORKER_API_KEY", ""),
        routing=RoutingSettings(args.routing, args.request_cost_tokens),
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        request_timeout_s=args.request_timeout_s,
        poll_interval_s=args.poll_interval_s,
        grace_s=args.grace_s,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:
        template = load_chat_template(config.model_dir, config.chat_template)
    except (TemplateError, OSError) as exc:
        raise SystemExit(f"chat template: {exc}") from None
    if template is None:
        log.warning("no chat template (give --model DIR or --chat-template FILE): /v1/chat/completions answers 400")
    stop_tracing = telemetry.setup_tracing("hybridserve-gateway")
    try:
        asyncio.run(serve(config, template))
    finally:
        stop_tracing()
    return 0


async def serve(config: GatewayConfig, template: ChatTemplate | None) -> None:
    metrics = GatewayMetrics()
    table = PrefixTable()
    metadata = (("authorization", f"Bearer {config.worker_api_key}"),) if config.worker_api_key else ()
    pool = WorkerPool(config.workers, poll_interval_s=config.poll_interval_s, metadata=metadata, on_down=table.forget)
    await pool.start()
    dispatcher = Dispatcher(pool, table, config.routing, metrics)
    tokenizer = GatewayTokenizer.from_model_dir(config.model_dir)
    gateway = Gateway(
        dispatcher, metrics, config.api_keys, config.served_model_name, tokenizer, template, config.request_timeout_s
    )
    runner = web.AppRunner(build_app(gateway, config.max_body_bytes), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_port=False)
    await site.start()
    http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"listening on {config.host}:{http_port}", flush=True)
    proxy = GenerationProxy(dispatcher, metrics, config.api_keys, tokenizer, config.request_timeout_s)
    grpc_server, grpc_port, health_servicer = create_grpc_server(proxy, config.host, config.grpc_port)
    await grpc_server.start()
    print(f"grpc listening on {config.host}:{grpc_port}", flush=True)
    log.info("routing %s over %s", config.routing.mode, ", ".join(config.workers))
    readiness = asyncio.create_task(watch_readiness(dispatcher, health_servicer, config.poll_interval_s))
    await _until_signal()
    log.info("shutting down")
    readiness.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await readiness
    await health_servicer.enter_graceful_shutdown()
    await grpc_server.stop(config.grace_s)
    await runner.cleanup()
    await pool.close()
    log.info("stopped")


async def _until_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
