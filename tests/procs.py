"""Real `hybridserve` processes for tests, on the one child-process helper (hybridserve.children)."""

from __future__ import annotations

import signal
from collections.abc import Sequence

from hybridserve.children import Child, hybridserve_command


class ServerProcess(Child):
    """A `hybridserve ARGS` child whose `listening on HOST:PORT` line has been read; every line of its
    output is kept (`output`)."""

    def __init__(self, args: Sequence[str], timeout_s: float = 60.0, env: dict[str, str] | None = None) -> None:
        super().__init__(
            args[0] if args else "hybridserve",
            hybridserve_command(*args),
            env=env,
            keep_lines=100_000,
            die_with_parent=False,
        )
        try:
            self.wait_listening(timeout_s)
        except Exception:
            self.stop()
            raise RuntimeError(f"{' '.join(args)} did not start: {self.output}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:  # type: ignore[override]
        return super().stop(timeout_s, sig)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
