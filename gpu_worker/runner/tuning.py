"""Process-wide tuning for serving: the glibc allocator, torch's thread count, and the garbage
collector's view of start-up objects (`freeze_startup_objects`).

By default glibc serves large blocks (the per-step activations of a forward) with fresh mmap()s and
returns them on free, so every step page-faults its working set back in; in VMs a fault is expensive and
a decode step can run 10-30x slower than its arithmetic. Raising the mmap and trim thresholds keeps freed
memory in the heap for reuse. Call once at start-up, before the model runs; a no-op off glibc. The heap
then never shrinks by itself: a step that held more than its budget (or temporaries of sizes that do not
fit the holes the last step left) grows it for good. `StepMemoryTrim` gives what is free beyond the
activation budget back with malloc_trim after such steps.

A full collection of the cyclic garbage collector walks every object it tracks. After start-up most of
them are the model's and the libraries' (torch, gRPC, protobuf) and live as long as the process; a full
collection over them paused one step by tens of milliseconds (bench/bench_engine.py, 256 running
requests: about 70 ms each, every ~100 steps). `gc.freeze()` moves the objects that exist at start-up
into the permanent generation, which collections skip; objects made later (requests, steps) are
collected as before. Call it once, when the model and the engine are built and before serving."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from collections.abc import Callable

import torch

from gpu_worker.runner.settings import RunnerConfig

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


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def release_freed_memory() -> bool:
    """glibc's malloc_trim(0): the free memory of every heap goes back to the OS (the heaps' tops are cut,
    free pages inside them are madvised away). True when some was released; False off glibc."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


def anonymous_resident_bytes() -> int:
    """This process's resident memory less what is shared or file-backed (/proc/self/statm resident -
    shared): the heaps, the interpreter's and torch's own. 0 where /proc is not there."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
    except OSError:
        return 0
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


class StepMemoryTrim:
    """After a step, the freed memory beyond `keep_bytes` goes back to the OS: when this process's anonymous
    resident memory is more than `keep_bytes` above what it was after the last trim (or the first check),
    malloc_trim runs and the new figure is the line. Up to `keep_bytes` (the activation budget) stays in the
    heap for the next step to reuse without page faults (`keep_freed_memory`). A check reads one /proc file
    (~20 us); a trim costs about 0.5 ms per MB it gives back, so it is called after prefill steps only."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self.line: int | None = None  # anonymous resident bytes after the last trim, or the lowest seen since
        self.num_trims = 0

    def after_step(self) -> bool:
        """Trims when above the line; returns whether it did."""
        now = anonymous_resident_bytes()
        if self.line is None or now < self.line:
            self.line = now
            return False
        if now - self.line <= self.keep_bytes:
            return False
        release_freed_memory()
        self.line = anonymous_resident_bytes()
        self.num_trims += 1
        return True


def default_cpu_threads() -> int:
    """One intra-op thread per core this process may use, but one: the engine loop, the gRPC server
    and the stream threads need a core of their own. OpenMP threads wait for each other at the end of
    every op, so a thread that shares its core with them (or with another process) stalls every op of
    the forward: measured here on 2 busy cores, a decode step of 32 sequences took 81 ms with 2
    threads and 27 ms with 1."""
    return max(1, usable_cores() - 1)


# On auto threads, a model whose weights are at least this large decodes on every usable core. Its
# decode step reads the weights from memory, each op a projection of megabytes, so a second core's
# bandwidth outweighs the end-of-op barrier and the server threads' share of its core. In process, ms a
# decode step of 1 and 8 rows, one thread against two (2 cores, Xeon with AMX, the compiled program on
# both counts, 8 layers): 24 MiB (hidden 256, vocab 512) 1.85-1.93 / 5.7-6.4 against 1.41-1.44 /
# 3.2-3.4; 93 MiB (hidden 512) 9.5-9.7 / 21.6-23.2 against 4.9-5.5 / 13.1-13.5; 207 MiB (hidden 768)
# 17.9-18.4 / 40.2-42.1 against 10.0-10.3 / 23.0-26.5; 250 MiB (hidden 768, vocab 100,352, bfloat16)
# 36.0-36.9 / 51.0-52.1 against 21.3-22.1 / 27.0-28.6; about 500 MiB (the same in float32) 38.8-39.6 /
# 77.9-79.7 against 21.3-21.5 / 42.9-44.7. Served, the benchmark model (24 MiB) on two decode threads
# lost at one client (0.84x the tokens/s of one thread, ITL 3.20 against 2.68 ms: the worker's own
# threads need that core between its 2 ms steps) and was even at 8 (1.01x): small models stay on one.
WIDE_DECODE_WEIGHT_BYTES = 128 << 20


def decode_threads(config: RunnerConfig, weight_bytes: int) -> int:
    """Threads of a step without prompt tokens (RunnerConfig.cpu_decode_threads): the setting where it is
    set; on auto, for a model of at least WIDE_DECODE_WEIGHT_BYTES of weights, every usable core (in a
    model process among several, its lone threads: StepThreads takes them only while the other processes
    are idle); else the step's usual count (--cpu-threads, or its auto). A --cpu-threads set by hand
    keeps decode steps on it (model_process.resolve_processes carries it over)."""
    if config.cpu_decode_threads:
        return config.cpu_decode_threads
    if weight_bytes >= WIDE_DECODE_WEIGHT_BYTES:
        return max(config.model_process_lone_threads, config.cpu_threads or usable_cores())
    return config.cpu_threads or default_cpu_threads()


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
    hundreds of rows that split well). A model process among several (gpu_worker.runner.model_process) also has
    `lone`: while the other processes are idle (`others_idle`), its step runs on that many threads, their
    cores too: from the start when they got no part of this step (steps of at least `lone_min_tokens`
    prefill tokens), or from the block where they have finished theirs (`widen`, called between blocks;
    at least `widen_min_tokens`). `decode` (0 = `few`): the threads of a step without prompt tokens
    (`decode_threads`); more than `few` only while the other processes are idle, if there are others.
    Switching costs some microseconds, paid only on a change."""

    def __init__(
        self,
        few: int,
        many: int,
        min_tokens: int,
        lone: int = 0,
        lone_min_tokens: int = 0,
        widen_min_tokens: int = 0,
        decode: int = 0,
    ) -> None:
        self.few, self.many, self.min_tokens = few, max(few, many), min_tokens
        self.decode = decode or few
        self.lone, self.lone_min_tokens, self.widen_min_tokens = lone, lone_min_tokens, widen_min_tokens
        self.others_idle: Callable[[], bool] | None = None
        self._prefill_tokens = 0
        self.current = set_cpu_threads(few)
        self.widened = False  # the current step has run on the lone threads (from some block on)

    def for_step(self, num_tokens: int, prefill_tokens: int | None = None) -> int:
        """`prefill_tokens` (the multi-token chunks' tokens; all of them when not given) decide the lone
        threads: decode rows stay on one thread however many (64 rows on two threads, served at 64
        clients: 1,323.6 against 1,727.0 tok/s)."""
        self._prefill_tokens = num_tokens if prefill_tokens is None else prefill_tokens
        if num_tokens >= self.min_tokens:
            wanted = self.many
        elif prefill_tokens == 0 and (self.decode <= self.few or self.others_idle is None or self.others_idle()):
            wanted = self.decode  # a decode-only step: wider only where no other process computes
        else:
            wanted = self.few
        self.widened = self._may_widen(wanted, self.lone_min_tokens)
        self._set(self.lone if self.widened else wanted)
        return self.current

    def decode_counts(self, max_tokens: int = 1) -> tuple[int, ...]:
        """The thread counts `for_step` gives a step without prompt tokens of at most `max_tokens` tokens
        (decode or verify): `decode`, and `few` where `decode` is wider (taken only while the other
        processes are idle); `many` from `min_tokens`. The compiled decode programs are compiled under
        each: torch.compile's guards check the count (gpu_worker.model.backends.cpu.compiled_decode)."""
        counts = {self.decode, self.few} if self.decode > self.few else {self.decode}
        if max_tokens >= self.min_tokens:
            counts.add(self.many)
        return tuple(sorted(counts))

    def widen(self) -> None:
        """Between two blocks of a forward: the lone threads, once the other processes are idle."""
        if self._may_widen(self.current, self.widen_min_tokens):
            self._set(self.lone)
            self.widened = True

    def _may_widen(self, threads: int, min_tokens: int) -> bool:
        idle = self.others_idle
        return self.lone > threads and self._prefill_tokens >= min_tokens and idle is not None and idle()

    def _set(self, threads: int) -> None:
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads


def freeze_startup_objects() -> int:
    """Collects what start-up left behind, then freezes the rest; returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
