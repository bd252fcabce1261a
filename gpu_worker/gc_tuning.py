"""The cyclic garbage collector and the engine's steps.

A full collection walks every object the collector tracks. After start-up most of them are the
model's and the libraries' (torch, gRPC, protobuf) and live as long as the process; a full
collection over them paused one step by tens of milliseconds (bench/bench_engine.py, 256 running
requests: about 70 ms each, every ~100 steps). `gc.freeze()` moves the objects that exist at start-up
into the permanent generation, which collections skip; objects made later (requests, steps) are
collected as before. Call once, when the model and the engine are built and before serving."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collects what start-up left behind, then freezes the rest; returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
