"""The worker's health probes and its drain.

- liveness: the engine loop runs (restart the process if not).
- readiness: the model is loaded (the server starts only after it), a scheduler answers, and the
  worker is not draining. A scheduler outage makes the worker unready, never dead.
- drain, on SIGTERM or SIGINT: readiness turns NOT_SERVING and new Generate calls get UNAVAILABLE at
  once; requests in flight run to their end for up to `drain_timeout_s`; whatever is left then ends
  with UNAVAILABLE (the engine stops) and the server stops. Health, GetInfo and Abort answer
  throughout. An orchestrator must allow `drain_timeout_s` plus a few seconds before SIGKILL.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from gpu_worker.engine.engine import Engine
from gpu_worker.service import GenerationServicer
from hybridserve import grpc_server

log = logging.getLogger("hybridserve.worker")

FINAL_GRACE_S = 2.0  # after the engine stopped: the last statuses reach their clients


def watch(
    health: grpc_server.Health,
    engine: Engine,
    servicer: GenerationServicer,
    scheduler_reachable: Callable[[], bool],
    interval_s: float = 0.5,
) -> threading.Event:
    """Keeps liveness and readiness current (see the module docstring); set the event to stop."""
    return grpc_server.watch_health(
        health,
        is_alive=engine.is_alive,
        is_ready=lambda: not servicer.draining and scheduler_reachable(),
        interval_s=interval_s,
    )


def wait_for_signal() -> None:
    """Blocks until SIGTERM or SIGINT."""
    received = threading.Event()

    def handle(signum: int, _frame: Any) -> None:
        log.info("received %s: draining", signal.Signals(signum).name)
        received.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
    received.wait()


def drain(
    server: grpc.Server,
    health: grpc_server.Health,
    servicer: GenerationServicer,
    engine: Engine,
    drain_timeout_s: float,
    poll_s: float = 0.05,
) -> int:
    """Stops admitting, waits up to drain_timeout_s for the requests in flight, ends the rest with
    UNAVAILABLE and stops the server; returns how many requests were cut."""
    health.enter_graceful_shutdown()
    servicer.drain()
    deadline = time.monotonic() + drain_timeout_s
    while engine.num_live and time.monotonic() < deadline and engine.is_alive():
        time.sleep(poll_s)
    cut = engine.num_live
    if cut:
        log.warning("drain timeout (%.0f s): ending %d requests still in flight", drain_timeout_s, cut)
    engine.stop()  # every request still live ends with UNAVAILABLE
    server.stop(FINAL_GRACE_S).wait()
    log.info("drained; stopped")
    return cut
