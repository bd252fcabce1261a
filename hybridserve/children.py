"""Child processes, the one helper for `hybridserve up`, the embedded Redis (cache_svc.embedded_redis),
the tests (tests/procs.py) and the benchmarks: start a `hybridserve ...` (or any) command, relay its
output line by line with the service name in front, learn its address from its `listening on
HOST:PORT` line, and stop it cleanly (SIGTERM, wait, then SIGKILL).

Children run in their own session, so a Ctrl-C in the terminal reaches only the parent, which stops
them in order (worker before scheduler). On Linux each child also gets SIGTERM when its parent dies,
even by SIGKILL, so no child outlives it."""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

LISTENING = re.compile(r"listening on (\S+):(\d+)")
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


class Interrupted(Exception):
    """Raised out of a wait when the parent was asked to stop (SIGTERM or Ctrl-C)."""


class ChildExited(Exception):
    """A child ended while it was expected to run (or to start)."""

    def __init__(self, child: Child) -> None:
        self.child = child
        super().__init__(child.exit_report())


def parse_listening(line: str) -> tuple[str, int] | None:
    """(host, port) from a server's `listening on HOST:PORT` line; None for any other line."""
    match = LISTENING.search(line)
    if match is None:
        return None
    host = match.group(1)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(match.group(2))


def connect_address(host: str, port: int) -> str:
    """An address a client on this machine can dial: a wildcard bind host becomes 127.0.0.1."""
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for servers that cannot bind port 0 and report it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that were free a moment ago: all are held bound at once, since ports
    asked for one at a time may repeat."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def hybridserve_command(*args: str) -> list[str]:
    """`hybridserve ARGS` run by this interpreter, so children use the same installation."""
    return [sys.executable, "-m", "hybridserve_cli", *args]


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that asks Linux to SIGTERM the child when the parent dies; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return preexec


class Child:
    """One running child process whose merged stdout/stderr is drained by a background thread.

    Each line is kept (the last `keep_lines` of them) and handed to `relay` (which may print it);
    the first `listening on` line sets `host`/`port` and the `ready` event.

    `die_with_parent` needs a fork that runs Python before exec: a parent that runs gRPC (servers or
    channels in-process, as tests do) must pass False, or gRPC's fork handlers may abort the child."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        relay: Callable[[str, str], None] | None = None,
        env: dict[str, str] | None = None,
        keep_lines: int = 40,
        die_with_parent: bool = True,
    ) -> None:
        self.name = name
        self.command = list(command)
        self.lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self.ready = threading.Event()
        self.host = ""
        self.port = 0
        self._relay = relay
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
            preexec_fn=_die_with_parent() if die_with_parent else None,
        )
        self._drained = threading.Event()
        threading.Thread(target=self._drain, name=f"relay-{name}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        """Where clients dial this child; empty until its `listening on` line was read."""
        return connect_address(self.host, self.port) if self.ready.is_set() else ""

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        try:
            for raw in self.proc.stdout:
                line = raw.rstrip("\n")
                self.lines.append(line)
                found = None if self.ready.is_set() else parse_listening(line)
                if found is not None:
                    self.host, self.port = found
                    self.ready.set()
                if self._relay is not None:
                    self._relay(self.name, line)
        finally:
            self._drained.set()

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def wait_listening(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> str:
        """Blocks until the child printed `listening on HOST:PORT`; returns its dialable address.

        Raises ChildExited if it ends first, TimeoutError after timeout_s, Interrupted when
        should_stop() turns true."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.1):
            if should_stop():
                raise Interrupted()
            if not self.is_running():
                self._drained.wait(2.0)
                if not self.ready.is_set():
                    raise ChildExited(self)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not print 'listening on' within {timeout_s:.0f} s")
        return self.address

    def wait_exit(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Blocks until the child ends (a one-shot command); returns its exit code."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            if should_stop():
                raise Interrupted()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not finish within {timeout_s:.0f} s")
            time.sleep(0.1)
        self._drained.wait(2.0)
        return self.proc.returncode

    @property
    def output(self) -> str:
        """The lines kept so far (the last `keep_lines`), joined."""
        return "\n".join(self.lines)

    def stop(self, timeout_s: float = 15.0, sig: int = signal.SIGTERM) -> int:
        """`sig` (SIGTERM), wait up to timeout_s, then SIGKILL; returns the exit code. Safe to call twice."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._drained.wait(2.0)
        return self.proc.returncode

    def exit_report(self, max_lines: int | None = None) -> str:
        """Which child ended, how, and its last lines (all kept, or the last `max_lines`): what a
        person needs to see why."""
        code = self.proc.poll()
        how = "is still running" if code is None else _describe_exit(code)
        lines = list(self.lines)[-max_lines:] if max_lines else list(self.lines)
        tail = "\n".join(f"    {line}" for line in lines) or "    (no output)"
        return f"{self.name} (pid {self.pid}) {how}; its last lines:\n{tail}"


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stop_all(children: Sequence[Child], timeout_s: float = 15.0) -> None:
    """Stops children in the given order (dependants first), each with SIGTERM then SIGKILL."""
    for child in children:
        child.stop(timeout_s)
