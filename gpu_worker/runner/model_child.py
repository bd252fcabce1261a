"""A model process's side (gpu_worker.runner.model_process): it loads the model over the worker's shared
weights and pools, then carries out each message (gpu_worker.runner.messages) until `Stop` or the worker
goes away: a step's forward, and the sampling of the rows that yield, here where the logits are."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import pickle
import signal
import sys
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import numpy as np
import torch

from gpu_worker.model.loader import load_model
from gpu_worker.runner.batch import Batch
from gpu_worker.runner.messages import (
    PROTOCOL_VERSION,
    Failed,
    MasksReady,
    Ready,
    Step,
    StepDone,
    StepTables,
    Stop,
    TableReader,
    Warm,
    WarmUp,
    has_masked_rows,
    table_mask_words,
)
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.sampling import sample_step
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.shared_memory import AttachedArena, Shapes, share_weights
from gpu_worker.runner.speculation import masked_draft_counts, roll_back, verify_drafts
from hybridserve.errors import InvalidArgumentError

log = logging.getLogger("hybridserve.worker.model_process")
PR_SET_PDEATHSIG = 1  # prctl: the signal this process gets when its parent dies


def serve(
    conn: Connection, model_dir: str, config: RunnerConfig, shapes: Shapes, weight_shapes: Shapes,
    weight_names: list[str], log_level: int, index: int, count: int,
) -> None:  # fmt: skip
    """Model process `index` (of `count`)'s loop: carry out each message until `Stop` or the worker goes away."""
    from gpu_worker.runner.tuning import keep_freed_memory

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    _follow_the_worker()
    fds = [recv_handle(conn) for _ in shapes]
    weight_fds = [recv_handle(conn) for _ in weight_shapes]
    keep_freed_memory()
    try:
        loaded = load_model(model_dir, device="cpu", dtype=config.dtype)
        if share_weights(loaded.model, AttachedArena(weight_fds, weight_shapes)) != weight_names:
            raise ValueError("the model process built other parameters than the worker's")
        pool = AttachedArena(fds, shapes)
        runner = ModelRunner(loaded, replace(config, device="cpu"), alloc=pool.zeros)
        busy = pool.zeros((count,), torch.int32).numpy()  # the worker's order: pools, busy flags, step tables
        reader = TableReader(StepTables(
            runner.state_pool.num_slots, runner.kv_pool.num_pages, runner.config.vocab_size,
            runner.kv_pool.page_size_tokens, pool.zeros, table_mask_words(loaded), config.num_draft_rows,
        ))  # fmt: skip
        if not pool.complete:
            raise ValueError("the worker shared more tensors than this process built")
    except Exception as exc:  # reported to the worker, which fails its start-up with it
        conn.send_bytes(pickle.dumps(Failed(f"{type(exc).__name__}: {exc}")))
        return
    others = [i for i in range(count) if i != index]
    if runner.step_threads is not None and others:
        runner.step_threads.others_idle = lambda: not busy[others].any()
        runner.model.between_blocks = runner.step_threads.widen
    for fd in fds + weight_fds:
        os.close(fd)  # the mappings keep the memory
    conn.send_bytes(pickle.dumps(Ready(PROTOCOL_VERSION, runner.describe())))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            runner.close()
            return  # the worker is gone
        if isinstance(message, Stop):
            runner.close()
            return
        if isinstance(message, WarmUp):
            reply: Any = _warm_up(runner, message.steps)
        elif isinstance(message, Step):
            reply = _step(runner, reader, message, conn)
            busy[index] = 0  # before the reply: the worker marks the next step's processes before sending
        else:
            reply = Failed(f"unknown message {type(message).__name__}")
        try:
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            runner.close()
            return  # the worker is gone


def _follow_the_worker() -> None:
    """The worker decides when this process ends: Ctrl-C or SIGTERM sent to the process group drain the
    worker, which then says "stop"; and should the worker die without a word, so does this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _warm_up(runner: ModelRunner, steps: tuple[Batch, ...]) -> Warm | Failed:
    try:
        return Warm(runner.warm_up_with(steps))
    except Exception as exc:
        log.exception("warm-up failed")
        return Failed(f"{type(exc).__name__}: {exc}")


def _step(runner: ModelRunner, reader: TableReader, step: Step, conn: Connection) -> StepDone | Failed:
    """The forward of the step's rows, and the sampling of those that yield, here where the logits are.
    A step with masked rows reads the worker's `MasksReady` once its forward is done (whether or not it
    succeeded: the pipe stays in step), then samples with the masks."""
    started = time.perf_counter()
    masked = has_masked_rows(step)
    try:
        try:
            batch, sampling, slots = reader.decode(step)
            out = runner.forward(batch)
        finally:
            if masked and not isinstance(ready := pickle.loads(conn.recv_bytes()), MasksReady):
                raise RuntimeError(f"expected the step's masks, got {type(ready).__name__}")
        bitmask, before = reader.masks_of(slots, masked_draft_counts(batch, sampling)) if masked else (None, [])
        rows_masks = bitmask[: len(slots)] if bitmask is not None else None
        sampled = sample_step(out.logits, batch, sampling, reader.tables.history, rows_masks, out.stats)
        if out.draft_logits:  # speculation: the drafts checked, the states rolled back to the accepted ones
            sampled = verify_drafts(out, batch, sampling, sampled, reader.tables.history, bitmask, before)
            roll_back(runner.state_pool, batch, sampled.drafts, out.draft_records)
        if out.hidden is not None:  # the MTP head's drafts for the next step
            sampled = replace(sampled, proposals=runner.propose_mtp(batch, out, sampling, sampled))
    except InvalidArgumentError as exc:
        return Failed(str(exc), invalid=True)
    except Exception as exc:
        log.exception("forward failed")
        return Failed(f"{type(exc).__name__}: {exc}")
    status = runner.decode_compiler.status if runner.decode_compiler is not None else "off"
    widened = runner.step_threads is not None and runner.step_threads.widened
    logits = _array(out.logits) if step.want_logits else None
    all_logits = [_array(a) for a in out.all_logits] if step.want_logits and out.all_logits is not None else None
    return StepDone(
        sampled.token_ids, sampled.logprobs, sampled.top_logprobs, time.perf_counter() - started, widened, status,
        logits, all_logits, out.prompt_scores, sampled.drafts, sampled.proposals,
    )  # fmt: skip


def _array(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    return tensor.detach().contiguous().numpy()
