"""Process-wide glibc allocator tuning for CPU serving.

By default glibc serves large blocks (the per-step activations of a forward) with fresh mmap()s and
returns them on free, so every step page-faults its working set back in; in VMs a fault is expensive and
a decode step can run 10-30x slower than its arithmetic. Raising the mmap and trim thresholds keeps freed
memory in the heap for reuse. Call once at start-up, before the model runs; a no-op off glibc."""

from __future__ import annotations

import ctypes
import ctypes.util

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
