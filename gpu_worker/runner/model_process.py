"""The model in its own process: `ProcessRunner` is the runner the engine and the prefix cache see, and a
child process runs the forward.

Why. In one process the forward shares the interpreter lock with everything else the worker does: the
Generation stream threads, the planner thread's PlanStep call, the gRPC server. Every torch op lets go
of the lock and takes it back, and each time another thread holds it the forward waits. Measured on a
CPU worker under 32 streaming clients (pinned to its own core): a 32-sequence decode forward took
13.9 ms of wall time for 11.7 ms of CPU. In a process of its own the forward only waits for its core,
and the worker's threads run beside it, on another core.

How. The worker keeps the pools' bookkeeping (page and slot allocation, reference counts, checkpoint
slots) and the pools' tensors live in memory both processes map (gpu_worker.runner.shared_memory): the
prefix cache reads and writes states and pages there as before. Each step the engine sends the
`Batch` (pickled: token ids, page tables, slots) over a pipe and waits; the child runs
`ModelRunner.forward` over the same pool tensors and sends back the logits. The engine calls the
runner from one thread and waits for each forward, so the two processes never write the pools at the
same time.

Several model processes (`model_processes`, CPU cores to spare): each step's sequences are dealt among
them (`Split`), sent to all, and the logits put back in batch order. A sequence's work touches only its
own pages and state slot, so the processes never write the same memory. The decode rows stay together
in the first process (cut in two, a decode group costs each half nearly what the whole does: the
weights are read once per forward, whatever the rows), and the prefill chunks are dealt, longest first,
to whichever process would finish first by an estimate of their cost (`gpu_worker.runner.step_split`: tokens,
a decode row counting 2.5, plus a forward's fixed cost) over each process's share; the shares follow how fast
each process went (its core may be busy with the worker's own threads). Small steps (below
`model_process_split_min_tokens`) go to the first process alone.

The weights are in memory too (`share_weights`): one copy, whatever the number of model processes (each
process may add its own prepacked copy of the projections: gpu_worker.model.backends.cpu.linear).
Each child loads the checkpoint to build its modules, then points every parameter at the worker's
copy and frees its own; the worker drops its references once the children are ready, unless small
steps run at home (it keeps the config, tokenizer and fingerprint). Each child compiles its decode step and
builds its kernels in the background from its start; `warm_up` waits for them and runs the warm-up steps in
each child in turn (gpu_worker.runner.warmup). CPU only: a CUDA runner stays in the worker's process.
Should the child die, every forward fails with UNAVAILABLE-class errors, `alive` turns false (the worker's
health reports NOT_SERVING) and the worker must be restarted.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_worker.model.loader import LoadedModel, load_model
from gpu_worker.runner.batch import Batch, ForwardOutput
from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.runner import ModelRunner, PoolPlan, RunnerConfig, RunnerFacts
from gpu_worker.runner.shared_memory import AttachedArena, Shapes, SharedArena, share_weights
from gpu_worker.runner.state_pool import MambaStatePool
from gpu_worker.runner.step_split import Split
from gpu_worker.runner.tuning import usable_cores
from gpu_worker.runner.warmup import WarmupTimes, scratch_steps
from hybridserve.errors import InvalidArgumentError

log = logging.getLogger("hybridserve.worker.model_process")
START_TIMEOUT_S = 600.0  # loading and (on a cold cache) nothing else: the decode compile runs in the background
WARM_UP_TIMEOUT_S = 1800.0  # the warm-up waits for the decode compile: a cold inductor cache on a busy machine
STOP_TIMEOUT_S = 10.0
MODEL_PROCESS_MODES = ("auto", "on", "off")
PR_SET_PDEATHSIG = 1  # prctl: the signal this process gets when its parent dies


class ModelProcessError(RuntimeError):
    """The model process is gone (crashed, killed, or never started)."""


def wants_model_process(config: RunnerConfig, device: torch.device) -> bool:
    """auto: on CPU (where the forward runs on the caller's thread), never on CUDA; on: CPU or an error."""
    mode = config.model_process
    if mode == "off":
        return False
    if device.type != "cpu":
        if mode == "on":
            raise InvalidArgumentError(f"model_process=on runs the model on CPU only; the device is {device}")
        return False
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


def resolve_processes(config: RunnerConfig) -> tuple[int, RunnerConfig]:
    """How many model processes to start, and the config each one runs. `model_processes` 0 (auto): two
    when this process may use at least two cores, else one. Torch threads left on auto (`cpu_threads` 0)
    are shared out: each process gets its part of the cores but one (at least one thread), so that
    several processes' OpenMP threads never outnumber the cores. A step that one process computes alone
    (the others wait for work: a lone prompt's chunk) may use their threads: `model_process_lone_threads`
    on auto is the processes' threads together, or the cores but one where that is more."""
    count = config.model_processes or (2 if usable_cores() >= 2 else 1)
    if count > 1 and config.cpu_threads == 0:
        config = replace(config, cpu_threads=max(1, (usable_cores() - 1) // count))
    if count > 1 and config.model_process_lone_threads == 0:  # a step one computes alone: the others' cores too
        lone = max(count * (config.cpu_threads or 1), usable_cores() - 1)
        config = replace(config, model_process_lone_threads=lone)
    return count, config


class ProcessRunner(RunnerFacts):
    """The ModelRunner surface the engine and the prefix cache use; the forward runs in a child process.
    Not thread-safe: one engine thread calls `forward`."""

    def __init__(self, loaded: LoadedModel, config: RunnerConfig) -> None:
        self.loaded = loaded
        self.device = loaded.device
        plan = PoolPlan.of(loaded, config)
        self.runner_config = plan.config
        self.kv_bytes_per_token = plan.kv_bytes_per_token
        self.state_bytes_per_request = plan.state_bytes_per_request
        self.memory = plan.memory
        count, child_config = resolve_processes(config)
        arena = SharedArena("hybridserve-pool")
        self.kv_pool: KVPagePool
        self.state_pool: MambaStatePool
        self.kv_pool, self.state_pool = plan.build(arena.zeros)
        # 1 while a model process computes its part of a step: set here before the parts go out, cleared by
        # the process when done (the others may then take its cores: StepThreads.widen)
        self._busy = arena.zeros((count,), torch.int32).numpy()
        weights = SharedArena("hybridserve-weights")
        weight_names = share_weights(loaded.model, weights)  # one copy, whatever the number of processes
        context = multiprocessing.get_context("spawn")  # never fork a process that runs torch threads
        self._lock = threading.Lock()
        self._children: list[_Child] = []
        try:
            for index in range(count):
                self._children.append(_Child.start(context, index, loaded, child_config, arena, weights, weight_names))
            arena.close()
            weights.close()
            replies = [child.receive(START_TIMEOUT_S) for child in self._children]
        except BaseException:
            self.close()
            raise
        failed = [r for r in replies if r[0] != "ready"]
        if failed:
            self.close()
            raise ModelProcessError(f"the model process did not start: {failed[0][1]}")
        reply = replies[0]
        self._split = Split(len(self._children), config.model_process_split_min_tokens)
        self._describe: dict[str, Any] = reply[1]
        self._alive = True
        self._warming_up = False  # warm_up waits for the children
        self.steps_here = 0  # steps run in this process (fewer rows than min_rows)
        self.steps_there = 0  # steps run in the model process(es)
        self.steps_shared = 0  # of those, steps shared among several model processes
        self.lone_parts = 0  # parts of steps run (at least from some block on) on the idle processes' cores too
        # What torch work stays here (sampling a step's rows, the prefix cache's copies) is small: one
        # thread, so that no OpenMP thread of this process spins on the core the model runs on.
        torch.set_num_threads(1)
        self.min_rows = config.model_process_min_rows
        self._local: ModelRunner | None = None
        if self.min_rows > 0:  # small steps here, eagerly, on one thread, over the same pools
            local_config = replace(config, cpu_threads=1, cpu_prefill_threads=0, decode_compile="off")
            self._local = ModelRunner(loaded, local_config, pools=(self.kv_pool, self.state_pool))
        else:
            _strip_weights(loaded.model)  # the children map the shared copy
        pids = ", ".join(str(c.pid) for c in self._children)
        log.info("model process %s ready" if len(self._children) == 1 else "model processes %s ready", pids)

    @property
    def alive(self) -> bool:
        """The model process runs (checked each step and by the worker's liveness probe)."""
        return self._alive and all(c.process.is_alive() for c in self._children)

    @property
    def pid(self) -> int | None:
        """The first model process's (there may be several: `pids`)."""
        return self._children[0].pid if self._children else None

    @property
    def pids(self) -> list[int | None]:
        return [c.pid for c in self._children]

    def runs_elsewhere(self, batch: Batch) -> bool:
        """Whether `batch` goes to the model process (then `forward`'s while_waiting runs while it computes,
        and the engine plans there)."""
        return self._local is None or len(batch.sequences) >= self.min_rows

    def forward(self, batch: Batch, while_waiting: Callable[[], None] | None = None) -> ForwardOutput:
        """ModelRunner.forward in the child: the same logits, the same pool updates. `while_waiting` runs
        here once the child has the batch (work that need not wait for the logits). A step of fewer than
        `min_rows` rows runs here instead: too small for the hand-off to pay."""
        with self._lock:
            if not self.alive:
                raise ModelProcessError("the model process is gone; restart the worker")
            if self._local is not None and not self.runs_elsewhere(batch):
                self.steps_here += 1
                return self._local.forward(batch, while_waiting)
            self.steps_there += 1
            parts = self._split.assign(batch)
            sends = [batch]
            if len(parts) > 1:
                sends = [replace(batch, sequences=tuple(batch.sequences[i] for i in p)) for p in parts]
            self._busy[: len(sends)] = 1
            try:
                for child, part in zip(self._children, sends, strict=False):
                    child.send(("forward", part))
                if while_waiting is not None:
                    while_waiting()
                replies = [child.receive(None) for child, _ in zip(self._children, sends, strict=False)]
            except (OSError, EOFError, ModelProcessError) as exc:
                self._alive = False
                codes = [c.process.exitcode for c in self._children if not c.process.is_alive()]
                raise ModelProcessError(f"the model process is gone (exit code {codes}); restart the worker") from exc
        for reply in replies:
            if reply[0] == "invalid":
                raise InvalidArgumentError(reply[1])
            if reply[0] == "error":
                raise RuntimeError(f"model process: {reply[1]}")
        self._describe["decode_compile"] = replies[0][3]
        self.lone_parts += sum(1 for r in replies if r[5])
        if len(parts) == 1:
            all_logits = None if replies[0][2] is None else tuple(torch.from_numpy(a) for a in replies[0][2])
            return ForwardOutput(logits=torch.from_numpy(replies[0][1]), all_logits=all_logits)
        self.steps_shared += 1
        self._split.learn(batch, parts, [r[4] for r in replies])
        order = [i for p in parts for i in p]
        joined = torch.cat([torch.from_numpy(r[1]) for r in replies])
        logits = torch.empty_like(joined)
        logits[torch.tensor(order)] = joined
        all_logits = None
        if replies[0][2] is not None:
            flat = [a for r in replies for a in r[2]]
            by_index = dict(zip(order, flat, strict=True))
            all_logits = tuple(torch.from_numpy(by_index[i]) for i in range(len(order)))
        return ForwardOutput(logits=logits, all_logits=all_logits)

    def warm_up(self) -> WarmupTimes:
        """ModelRunner.warm_up in every model process, one after the other on the same scratch pages and
        slots (their background compiles and kernel builds have run side by side since they started),
        and in the worker's own runner for small steps when there is one."""
        times = WarmupTimes()
        with self._lock, scratch_steps(self.kv_pool, self.state_pool, self.config.vocab_size) as steps:
            if not self.alive:
                raise ModelProcessError("the model process is gone; restart the worker")
            self._warming_up = True  # a close meanwhile kills the children: none reads its pipe till warm
            try:
                times = self._warm_up_children(steps)
            finally:
                self._warming_up = False
            if self._local is not None:
                times = times.beside(self._local.warm_up_with(steps))
        return times

    def _warm_up_children(self, steps: tuple[Batch, ...]) -> WarmupTimes:
        times = WarmupTimes()
        for child in self._children:
            try:
                child.send(("warm_up", steps))
                reply = child.receive(WARM_UP_TIMEOUT_S)
            except (OSError, EOFError, ModelProcessError) as exc:
                self._alive = False
                raise ModelProcessError("the model process is gone during its warm-up; restart the worker") from exc
            if reply[0] != "warm":
                raise RuntimeError(f"model process warm-up: {reply[1]}")
            times = times.beside(reply[1])
        self._describe["decode_compile"] = times.compile_status
        return times

    def describe(self) -> dict[str, int | str]:
        return {**self._describe, "model_process": self.pid or 0, "model_processes": len(self._children)}

    def close(self) -> None:
        """Stops the child (at shutdown); idempotent."""
        self._alive = False
        local = getattr(self, "_local", None)  # absent when the start failed
        if local is not None:
            local.close()
        for child in getattr(self, "_children", []):
            if getattr(self, "_warming_up", False):  # busy till warm (minutes, compiling): "stop" would wait
                child.process.kill()
            child.stop()


class _Child:
    """One model process and the worker's end of its pipe."""

    def __init__(self, process: Any, conn: Connection) -> None:
        self.process = process
        self.conn = conn

    @classmethod
    def start(
        cls, context: Any, index: int, loaded: LoadedModel, config: RunnerConfig, arena: SharedArena,
        weights: SharedArena, weight_names: list[str],
    ) -> _Child:  # fmt: skip
        conn, child_conn = context.Pipe()
        process = context.Process(
            target=serve, args=(child_conn, str(loaded.model_dir), config, arena.shapes, weights.shapes, weight_names,
                                log.getEffectiveLevel(), index),
            name=f"hybridserve-model-{index}", daemon=True,
        )  # fmt: skip
        process.start()
        child_conn.close()
        child = cls(process, conn)
        try:
            for fd in arena.fds + weights.fds:
                send_handle(conn, fd, process.pid)
        except BaseException:
            child.stop()
            raise
        return child

    @property
    def pid(self) -> int | None:
        return self.process.pid  # type: ignore[no-any-return]

    def send(self, message: tuple[str, Any]) -> None:
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def receive(self, timeout_s: float | None) -> tuple[Any, ...]:
        if timeout_s is not None and not self.conn.poll(timeout_s):
            raise ModelProcessError(f"no answer from the model process within {timeout_s:.0f} s")
        reply = pickle.loads(self.conn.recv_bytes())
        assert isinstance(reply, tuple)
        return reply

    def stop(self) -> None:
        if self.process.pid is None:
            return
        with contextlib.suppress(OSError, ValueError):  # already gone, or the pipe closed
            self.conn.send_bytes(pickle.dumps(("stop", None)))
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_TIMEOUT_S)
        self.conn.close()


def _strip_weights(model: torch.nn.Module) -> None:
    """Frees the worker's copy of the weights (the module tree stays, empty)."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        tensor.data = torch.empty(0, dtype=tensor.dtype)


def build_runner(model_dir: str | Path, config: RunnerConfig) -> Any:
    """The worker's runner: a ProcessRunner when `config.model_process` asks for one (see
    wants_model_process), else the in-process ModelRunner."""
    loaded = load_model(model_dir, device=config.device, dtype=config.dtype)
    if wants_model_process(config, loaded.device):
        return ProcessRunner(loaded, config)
    return ModelRunner(loaded, config)


# ---- the child --------------------------------------------------------------------------------------
def serve(
    conn: Connection, model_dir: str, config: RunnerConfig, shapes: Shapes, weight_shapes: Shapes,
    weight_names: list[str], log_level: int, index: int,
) -> None:  # fmt: skip
    """Model process `index`'s loop: forward each batch it receives until "stop" or the worker goes away."""
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
        count = shapes[-1][0][0]  # the busy flags, after the pools
        busy = pool.zeros((count,), torch.int32).numpy()
    except Exception as exc:  # reported to the worker, which fails its start-up with it
        conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}")))
        return
    others = [i for i in range(count) if i != index]
    if runner.step_threads is not None and others:
        runner.step_threads.others_idle = lambda: not busy[others].any()
        runner.model.between_blocks = runner.step_threads.widen
    for fd in fds + weight_fds:
        os.close(fd)  # the mappings keep the memory
    conn.send_bytes(pickle.dumps(("ready", runner.describe())))
    while True:
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            runner.close()
            return  # the worker is gone
        if kind == "stop":
            runner.close()
            return
        if kind == "warm_up":
            reply = pickle.dumps(_warm_up(runner, payload), protocol=pickle.HIGHEST_PROTOCOL)
        else:
            reply = pickle.dumps(_forward(runner, payload), protocol=pickle.HIGHEST_PROTOCOL)
            busy[index] = 0  # before the reply: the worker marks the next step's processes before sending
        try:
            conn.send_bytes(reply)
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


def _warm_up(runner: ModelRunner, steps: tuple[Batch, ...]) -> tuple[Any, ...]:
    try:
        return ("warm", runner.warm_up_with(steps))
    except Exception as exc:
        log.exception("warm-up failed")
        return ("error", f"{type(exc).__name__}: {exc}")


def _forward(runner: Any, batch: Batch) -> tuple[Any, ...]:
    started = time.perf_counter()
    try:
        out = runner.forward(batch)
    except InvalidArgumentError as exc:
        return ("invalid", str(exc))
    except Exception as exc:
        log.exception("forward failed")
        return ("error", f"{type(exc).__name__}: {exc}")
    status = runner.decode_compiler.status if runner.decode_compiler is not None else "off"
    all_logits = None if out.all_logits is None else [_array(a) for a in out.all_logits]
    widened = runner.step_threads is not None and runner.step_threads.widened
    return ("ok", _array(out.logits), all_logits, status, time.perf_counter() - started, widened)


def _array(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    return tensor.detach().contiguous().numpy()
