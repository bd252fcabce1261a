"""The worker's end of one model process (gpu_worker.runner.model_process): starting it on
gpu_worker.runner.model_child.serve with the shared arenas' handles, the pickled messages over its pipe
(their bytes counted), and stopping it."""

from __future__ import annotations

import contextlib
import logging
import pickle
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

from gpu_worker.model.loader import LoadedModel
from gpu_worker.runner import model_child
from gpu_worker.runner.messages import Stop
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.shared_memory import SharedArena

log = logging.getLogger("hybridserve.worker.model_process")
STOP_TIMEOUT_S = 10.0


class ModelProcessError(RuntimeError):
    """The model process is gone (crashed, killed, or never started)."""


class ChildHandle:
    """One model process and the worker's end of its pipe."""

    def __init__(self, process: Any, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.bytes_sent = 0
        self.bytes_received = 0

    @classmethod
    def start(
        cls, context: Any, index: int, count: int, loaded: LoadedModel, config: RunnerConfig, arena: SharedArena,
        weights: SharedArena, weight_names: list[str],
    ) -> ChildHandle:  # fmt: skip
        conn, child_conn = context.Pipe()
        process = context.Process(
            target=model_child.serve,
            args=(child_conn, str(loaded.model_dir), config, arena.shapes, weights.shapes, weight_names,
                  log.getEffectiveLevel(), index, count),
            name=f"hybridserve-model-{index}", daemon=True,
        )  # fmt: skip
        process.start()
        child_conn.close()
        child = cls(process, conn)
        try:
            for fd in arena.fds + weights.fds:
                send_handle(conn, fd, process.pid)
        except BaseException:
            child.stop()
            raise
        return child

    @property
    def pid(self) -> int | None:
        return self.process.pid  # type: ignore[no-any-return]

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.bytes_sent += len(data)
        self.conn.send_bytes(data)

    def receive(self, timeout_s: float | None) -> Any:
        if timeout_s is not None and not self.conn.poll(timeout_s):
            raise ModelProcessError(f"no answer from the model process within {timeout_s:.0f} s")
        data = self.conn.recv_bytes()
        self.bytes_received += len(data)
        return pickle.loads(data)

    def stop(self) -> None:
        if self.process.pid is None:
            return
        with contextlib.suppress(OSError, ValueError):  # already gone, or the pipe closed
            self.conn.send_bytes(pickle.dumps(Stop()))
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_TIMEOUT_S)
        self.conn.close()
