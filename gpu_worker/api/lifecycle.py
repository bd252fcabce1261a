"""The worker's health probes and its drain.

- liveness: the engine loop runs (restart the process if not).
- readiness: the model is loaded (the server starts only after it), a scheduler answers (a plan
  call or a probe; two probes in a row unanswered make it unready), and the worker is not draining.
  A scheduler outage makes the worker unready, never dead.
- drain, on SIGTERM or SIGINT: readiness turns NOT_SERVING and new Generate calls get UNAVAILABLE at
  once; requests in flight run to their end for up to `drain_timeout_s`; whatever is left then ends
  with UNAVAILABLE (the engine stops) and the server stops. Health, GetInfo and Abort answer
  throughout. An orchestrator must allow `drain_timeout_s` plus a few seconds before SIGKILL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from gpu_worker.api.service import GenerationServicer
from gpu_worker.engine.engine import Engine
from hybridserve import grpc_server

log = logging.getLogger("hybridserve.worker")

FINAL_GRACE_S = 2.0  # after the engine stopped: the last statuses reach their clients


class HealthWatch:
    """Keeps liveness and readiness current (see the module docstring) from a thread of its own,
    probing the scheduler every `interval_s`. `stop()` joins it, so no probe is in flight when the
    scheduler channel closes (a call in flight at interpreter exit can abort the process)."""

    def __init__(
        self,
        health: grpc_server.Health,
        engine: Engine,
        servicer: GenerationServicer,
        scheduler_reachable: Callable[[], bool],
        interval_s: float = 0.5,
    ) -> None:
        self._health, self._engine, self._servicer = health, engine, servicer
        self._reachable = scheduler_reachable
        self._interval_s = interval_s
        self._misses = 0  # probes in a row that no scheduler answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="health", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            alive = self._engine.is_alive()
            self._health.set_alive(alive)
            self._misses = 0 if self._reachable() else self._misses + 1
            # One slow probe on a loaded machine is not an outage: unready from the second miss on.
            reachable = self._misses < 2
            self._health.set_ready(alive and not self._servicer.draining and reachable)
            self._stop.wait(self._interval_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)


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
