"""What the engine does when something fails, so that no exception ends its loop silently.

- A step (prepare, forward, sample, apply) that raises fails the requests it involved with ABORTED
  (the same request may succeed if sent again), logged once with their ids; the loop goes on.
- A shared-tier fetch or import that raises is a cache miss for its request, logged once.
- The engine thread ending (stop, or a failure of the guard itself) ends every live request, and
  every later one, with UNAVAILABLE (this worker cannot serve: go elsewhere, or wait for a restart).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from hybridserve.errors import AbortedError, UnavailableError

log = logging.getLogger("hybridserve.engine")

P = ParamSpec("P")
T = TypeVar("T")


def step_failed(step_index: int, exc: BaseException, request_ids: list[str]) -> AbortedError:
    """Logs the failure once, with the traceback and the requests it fails; their error."""
    log.error(
        "step %d failed (%s: %s); failing %d requests: %s",
        step_index, type(exc).__name__, exc, len(request_ids), ", ".join(request_ids) or "none", exc_info=exc,
    )  # fmt: skip
    return AbortedError(
        f"the worker failed while serving this request (step {step_index}: {type(exc).__name__}: {exc}); send it again"
    )


def guarded(what: str, call: Callable[P, T | None], *args: P.args, **kwargs: P.kwargs) -> T | None:
    """`call(*args)`, or None (logged, naming `what`) if it raises: for work whose failure only
    loses an optimisation (a prefix-cache fetch or import is then a miss) or a clean-up."""
    try:
        return call(*args, **kwargs)
    except Exception:
        log.exception("%s failed; going on without it", what)
        return None


def shutting_down() -> UnavailableError:
    return UnavailableError("the worker is shutting down; send the request to another worker")


def engine_stopped(exc: BaseException) -> UnavailableError:
    log.critical("the engine loop stopped; every request now fails", exc_info=exc)
    return UnavailableError(
        f"this worker's engine stopped ({type(exc).__name__}: {exc}); send the request to another worker"
    )
