"""Keeping a stack's children alive: `hybridserve up` restarts a child that dies, with backoff, at
the address it announced first, and gives up when one keeps dying.

The rules, in the order a death meets them:

1. A server child (not a one-shot command) that is no longer running has died. Its death is told
   at once: which child, its exit code or signal, its last output lines.
2. Its restarts within the last `window_s` seconds are counted. With `max_restarts` of them behind
   it already, the supervisor gives up (`GaveUp`): a child that keeps dying is broken, not unlucky,
   and the caller stops the stack.
3. Otherwise restart number k (k = restarts in the window, plus one) waits `restart_delay_s(k)`,
   which doubles from `backoff_s` up to `max_backoff_s`: a child that dies at once does not spin.
4. The child is started again with its own command (ports pinned by the launcher, so dependants
   find it where they dialled it) and waited for until it listens. One that dies before it listens,
   or does not listen within the launcher's start timeout, is a death again: back to 2.

Compose and Kubernetes keep their own restart policies (deploy/); nothing there runs under this."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from hybridserve.children import ChildExited
from hybridserve.errors import InvalidArgumentError
from hybridserve_cli.stack import Service, Stack

log = logging.getLogger("hybridserve.supervise")

REPORT_LINES = 10  # last output lines of a dead child shown in its death report
POLL_S = 0.2  # how often the children are looked at


class GaveUp(Exception):
    """A child died more often than the restart policy allows; the message says which and how."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How often, and how soon, a dead child is started again."""

    max_restarts: int = 5  # restarts of one child within window_s before giving up; 0 = never restart
    window_s: float = 60.0  # seconds over which restarts are counted
    backoff_s: float = 1.0  # seconds before the first restart in the window; doubled for each further one
    max_backoff_s: float = 30.0  # the longest wait before a restart, in seconds

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise InvalidArgumentError(f"--max-restarts {self.max_restarts}: give 0 (never restart) or more")
        if self.window_s <= 0:
            raise InvalidArgumentError(f"--restart-window-s {self.window_s}: give a positive number of seconds")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise InvalidArgumentError(
                f"--restart-backoff-s {self.backoff_s}, --restart-backoff-max-s {self.max_backoff_s}: give "
                "0 <= backoff <= max backoff"
            )

    def restart_delay_s(self, attempt: int) -> float:
        """Seconds to wait before restart number `attempt` (1-based) within the window: doubling, so
        a child that dies at once is retried a few times quickly and then ever more slowly, capped so
        that a recovered dependency is picked up soon."""
        return min(self.backoff_s * 2.0 ** (attempt - 1), self.max_backoff_s)


class RestartLedger:
    """The times each child was restarted, forgotten once older than the policy's window."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._restarts: defaultdict[str, deque[float]] = defaultdict(deque)

    def next_attempt(self, name: str, now_s: float) -> int | None:
        """The number of the restart `name` would get now (1 = the first in the window), or None
        when it was restarted max_restarts times within the window already."""
        times = self._restarts[name]
        while times and times[0] <= now_s - self.policy.window_s:
            times.popleft()
        return None if len(times) >= self.policy.max_restarts else len(times) + 1

    def record(self, name: str, now_s: float) -> None:
        self._restarts[name].append(now_s)


def death_report(service: Service) -> str:
    """Which child died, how (exit code or signal), and its last lines."""
    return service.child.exit_report(REPORT_LINES)


class Supervisor:
    """Watches a started stack and restarts its server children as the policy says; each death,
    restart and recovery is logged (warnings for the first two)."""

    def __init__(self, stack: Stack, policy: RestartPolicy) -> None:
        self.stack = stack
        self.policy = policy
        self.ledger = RestartLedger(policy)

    def run(self, stop: threading.Event) -> None:
        """Returns once `stop` is set; raises GaveUp when a child dies more often than allowed (the
        caller stops the stack), Interrupted when asked to stop while a restart waits."""
        while not stop.wait(POLL_S):
            for service in self.stack.servers():
                if not service.child.is_running():
                    self.revive(service, stop)

    def giving_up(self, name: str) -> str:
        policy = self.policy
        if policy.max_restarts == 0:
            return f"{name} died and --max-restarts is 0: stopping the stack"
        return (f"{name} was restarted {policy.max_restarts} times within {policy.window_s:g} s and died again "
                f"(--max-restarts {policy.max_restarts}, --restart-window-s {policy.window_s:g}): giving up, "
                "stopping the stack")  # fmt: skip

    def revive(self, service: Service, stop: threading.Event) -> None:
        """Restarts a dead child until it listens again (rules 2-4 above)."""
        while not stop.is_set():
            report = death_report(service)
            attempt = self.ledger.next_attempt(service.name, time.monotonic())
            if attempt is None:
                raise GaveUp(f"{report}\n{self.giving_up(service.name)}")
            delay_s = self.policy.restart_delay_s(attempt)
            log.warning("%s\nrestarting %s at %s in %.1f s (attempt %d of %d within %g s)", report, service.name,
                        service.address, delay_s, attempt, self.policy.max_restarts, self.policy.window_s)  # fmt: skip
            if stop.wait(delay_s):
                return
            self.ledger.record(service.name, time.monotonic())
            try:
                address = self.stack.restart(service.name)
            except ChildExited:
                continue  # died before it listened: a death like any other
            except TimeoutError as exc:
                log.warning("%s; stopping it", exc)
                service.child.stop(self.stack.stop_timeout_s)
                continue
            log.info("%s is back at %s (pid %d, attempt %d)", service.name, address, service.child.pid, attempt)
            return
