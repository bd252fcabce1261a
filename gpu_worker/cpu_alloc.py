"""Process-wide tuning for CPU serving: the glibc allocator and torch's thread count.

By default glibc serves large blocks (the per-step activations of a forward) with fresh mmap()s and
returns them on free, so every step page-faults its working set back in; in VMs a fault is expensive and
a decode step can run 10-30x slower than its arithmetic. Raising the mmap and trim thresholds keeps freed
memory in the heap for reuse. Call once at start-up, before the model runs; a no-op off glibc."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_freed_memory(mmap_threshold_bytes: int = 1 << 30, trim_threshold_bytes: int = (1 << 31) - 1) -> bool:
    """Returns True when the thresholds were applied (Linux/glibc), False otherwise."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok_mmap = mallopt(M_MMAP_THRESHOLD, ctypes.c_int(min(mmap_threshold_bytes, (1 << 31) - 1)))
    ok_trim = mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim_threshold_bytes))
    return bool(ok_mmap and ok_trim)


def default_cpu_threads() -> int:
    """One intra-op thread per core this process may use, but one: the engine loop, the gRPC server
    and the stream threads need a core of their own. OpenMP threads wait for each other at the end of
    every op, so a thread that shares its core with them (or with another process) stalls every op of
    the forward: measured here on 2 busy cores, a decode step of 32 sequences took 81 ms with 2
    threads and 27 ms with 1."""
    return max(1, usable_cores() - 1)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_cpu_threads(threads: int) -> int:
    """Sets torch's intra-op threads (0 = `default_cpu_threads()`); returns the count in use."""
    wanted = threads or default_cpu_threads()
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return wanted


class StepThreads:
    """Torch's intra-op threads per step: `few` for steps of fewer than `min_tokens` tokens (decode:
    small ops, where OpenMP's end-of-op barrier costs more than a second thread gains and the server
    threads need a core), `many` for steps computing at least `min_tokens` tokens (prefill: GEMMs of
    hundreds of rows that split well). Switching costs some microseconds, paid only on a change."""

    def __init__(self, few: int, many: int, min_tokens: int) -> None:
        self.few, self.many, self.min_tokens = few, max(few, many), min_tokens
        self.current = set_cpu_threads(few)

    def for_step(self, num_tokens: int) -> int:
        wanted = self.many if num_tokens >= self.min_tokens else self.few
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted
        return wanted
