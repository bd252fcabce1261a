"""CPU seconds of processes and threads read from /proc (Linux), for the benchmarks that split a served
run's CPU by process or wait for servers to go idle between runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(path: str) -> list[str]:
    """The fields of a /proc stat file after the command name (field 3 of stat(5) is index 0)."""
    return Path(path).read_text().rsplit(")", 1)[1].split()


def cpu_s(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (or of one of its threads)."""
    fields = _stat_fields(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14, 15 of stat)


def threads_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of `pid`, by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = cpu_s(pid, int(tid))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def tree_cpu_s(roots: list[int]) -> float:
    """CPU seconds used so far by the processes `roots` and all their descendants."""
    procs: dict[int, tuple[int, float]] = {}  # pid -> (parent pid, CPU seconds)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = _stat_fields(f"/proc/{entry}/stat")
            except OSError:  # gone meanwhile
                continue
            procs[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, list(roots)
    while todo:
        pid = todo.pop()
        total += procs.get(pid, (0, 0.0))[1]
        todo.extend(children.get(pid, []))
    return total


def wait_quiet(roots: list[int], max_cores: float = 0.05, window_s: float = 0.25, timeout_s: float = 15.0) -> float:
    """Waits until the process trees under `roots` use at most `max_cores` over a `window_s` window (vLLM's
    CPU worker spins a core for about a second after each run; whoever runs next would share the
    machine with it); returns the seconds waited. Without /proc, waits 2 s."""
    if not os.path.isdir("/proc/self"):
        time.sleep(2.0)
        return 2.0
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        before = tree_cpu_s(roots)
        time.sleep(window_s)
        if (tree_cpu_s(roots) - before) / window_s <= max_cores:
            break
    return time.monotonic() - started
