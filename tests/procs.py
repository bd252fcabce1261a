"""Start real `hybridserve` processes for tests and stop them cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

LISTENING = re.compile(r"listening on (\S+):(\d+)")


class ServerProcess:
    """A `hybridserve ...` child process whose `listening on HOST:PORT` line has been read.

    stdout and stderr are drained by background threads into `output`, so the child never blocks
    on a full pipe."""

    def __init__(self, args: Sequence[str], timeout_s: float = 60.0, env: dict[str, str] | None = None) -> None:
        self.args = [sys.executable, "-m", "hybridserve.cli", *args]
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self._found = threading.Event()
        self.address = ""
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._found.wait(timeout_s):
            self.stop()
            raise RuntimeError(f"{' '.join(args)} did not start: {self.output}")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = LISTENING.search(line)
            if match and not self.address:
                self.address = f"{match.group(1)}:{match.group(2)}"
                self._found.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        time.sleep(0.05)  # let the drain thread read the last lines
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
