"""The worker's start-up warm-up, its health probes and its drain.

- warm-up (`Warmup`): once the model is loaded the server starts and the engine thread warms the runner
  up before its first step (gpu_worker.runner.warmup: the decode compile, the oneDNN kernel builds, the
  warm-up steps; the CUDA graphs were captured while loading), each part's time logged and reported by
  GetInfo. Requests that arrive meanwhile wait for it. With --serve-while-warming there is none: the
  worker is ready once loaded and the compile and kernel builds finish in the background (steps decode
  eagerly until then, and a first call of a new shape pays for its kernel).
- liveness: the engine loop runs, its warm-up included (restart the process if not).
- readiness: the warm-up ended, a scheduler answers (a plan call or a probe; two probes in a row
  unanswered make it unready), and the worker is not draining. A scheduler outage makes the worker
  unready, never dead.
- drain, on SIGTERM or SIGINT: readiness turns NOT_SERVING and new Generate calls get UNAVAILABLE at
  once; requests in flight run to their end for up to `drain_timeout_s`; whatever is left then ends
  with UNAVAILABLE (the engine stops) and the server stops. Health, GetInfo and Abort answer
  throughout. An orchestrator must allow `drain_timeout_s` plus a few seconds before SIGKILL. Still
  warming up, nothing is waited for: the requests waiting for the warm-up end at once (the warm-up
  itself ends with the process; the model processes, busy warming, are killed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from gpu_worker.api.service import GenerationServicer
from gpu_worker.engine.engine import Engine
from gpu_worker.runner.warmup import WarmupTimes
from hybridserve import grpc_server

log = logging.getLogger("hybridserve.worker")

FINAL_GRACE_S = 2.0  # after the engine stopped: the last statuses reach their clients
ENGINE_STOP_S = 10.0  # how long the engine may take to end its step at shutdown
STOP_WHILE_WARMING_S = 0.5  # ... its warm-up, which can take minutes: not waited for
WARMING, WARM, SERVING_WHILE_WARMING = "warming", "warm", "serving while warming"


class Warmup:
    """The worker's start-up warm-up and its state: `WARMING` until `run` (the engine's warm_up hook, on
    the engine thread) ends, then `WARM`, or "failed: REASON" (logged; the worker serves all the same, as
    it would have without a warm-up); `SERVING_WHILE_WARMING` from the start when told to serve at once
    (then `hook` is None and nothing runs). `on_done` callbacks run once it ended."""

    def __init__(self, runner: Any, serve_while_warming: bool = False) -> None:
        self._runner = runner  # anything with warm_up() -> WarmupTimes (ModelRunner, ProcessRunner)
        self.state = SERVING_WHILE_WARMING if serve_while_warming else WARMING
        self.times = WarmupTimes()  # each part's seconds, once warm
        self.seconds = 0.0  # the warm-up's wall time, once it ended
        self.done_unix_s = 0.0  # when it ended (time.time()); readiness turns SERVING after it
        self.on_done: list[Callable[[], None]] = []
        self._done = threading.Event()
        self._cancelled = False  # the worker is stopping: an error the stop causes is no failure
        if serve_while_warming:
            self._done.set()

    @property
    def hook(self) -> Callable[[], None] | None:
        """The engine's warm_up argument: None when serving while warming."""
        return None if self.state == SERVING_WHILE_WARMING else self.run

    @property
    def is_done(self) -> bool:
        """Readiness may turn SERVING (warm, failed, or serving while warming)."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)

    def cancel(self) -> bool:
        """The worker stops (drain): True when the warm-up was still running (it ends with the process)."""
        self._cancelled = True
        return not self.is_done

    def run(self) -> None:
        log.info("warming up: readiness turns SERVING once it is done (--serve-while-warming: at once)")
        started = time.monotonic()
        try:
            self.times = self._runner.warm_up()
            state = WARM
        except Exception as exc:  # the model process gone (liveness says so), or a bug: serve as without it
            state = f"failed: {type(exc).__name__}: {exc}"[:300]
            if self._cancelled:
                log.info("warm-up ended by the stop after %.1f s", time.monotonic() - started)
            else:
                log.exception("warm-up failed after %.1f s; serving anyway", time.monotonic() - started)
        self.seconds, self.done_unix_s = time.monotonic() - started, time.time()
        self.state = state
        if state == WARM:
            log.info("warm in %.1f s: %s", self.seconds, self.times.describe())
        self._done.set()
        for callback in self.on_done:
            callback()


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
        warmup: Warmup | None = None,
        interval_s: float = 0.5,
    ) -> None:
        self._health, self._engine, self._servicer = health, engine, servicer
        self._reachable = scheduler_reachable
        self._warmup = warmup
        self._interval_s = interval_s
        self._misses = 0  # probes in a row that no scheduler answered
        self._was_ready = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        if warmup is not None and not warmup.is_done:  # before the server starts: never ready while warming
            health.set_ready(False)
            warmup.on_done.append(self._wake.set)  # readiness follows at once
        self._thread = threading.Thread(target=self._poll, name="health", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            alive = self._engine.is_alive()
            self._health.set_alive(alive)
            self._misses = 0 if self._reachable() else self._misses + 1
            # One slow probe on a loaded machine is not an outage: unready from the second miss on.
            reachable = self._misses < 2
            warm = self._warmup is None or self._warmup.is_done
            ready = alive and warm and not self._servicer.draining and reachable
            self._health.set_ready(ready)
            if ready and not self._was_ready:
                log.info("readiness SERVING")
            self._was_ready = ready
            self._wake.wait(self._interval_s)
            self._wake.clear()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)


def drain(
    server: grpc.Server,
    health: grpc_server.Health,
    servicer: GenerationServicer,
    engine: Engine,
    drain_timeout_s: float,
    poll_s: float = 0.05,
    warmup: Warmup | None = None,
) -> int:
    """Stops admitting, waits up to drain_timeout_s for the requests in flight, ends the rest with
    UNAVAILABLE and stops the server; returns how many requests were cut. Still warming up, nothing
    runs: the requests waiting for the warm-up end at once, and so does the engine's wait."""
    health.enter_graceful_shutdown()
    servicer.drain()
    warming = warmup is not None and warmup.cancel()
    deadline = time.monotonic() + (0.0 if warming else drain_timeout_s)
    while engine.num_live and time.monotonic() < deadline and engine.is_alive():
        time.sleep(poll_s)
    cut = engine.num_live
    if cut:
        log.warning("drain timeout (%.0f s): ending %d requests still in flight", drain_timeout_s, cut)
    engine.stop(STOP_WHILE_WARMING_S if warming else ENGINE_STOP_S)  # every request still live: UNAVAILABLE
    server.stop(FINAL_GRACE_S).wait()
    log.info("drained; stopped")
    return cut
