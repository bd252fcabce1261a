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
prefix cache reads and writes states and pages there as before. Each step the engine's `execute` writes
what changed of the rows' page tables and sampling parameters into shared tables and sends each model
process a small typed message (gpu_worker.runner.messages: seven integers a row and the chunks' tokens);
the process runs `ModelRunner.forward` over the same pool tensors, samples the rows that yield where the
logits are, and sends back token ids and log-probabilities. The engine calls the runner from one
thread and waits for each step, so the processes never write the pools at the same time.

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
Should a model process die, the step it was in fails (its requests get an error that says so), `alive` turns
false (the worker's health reports NOT_SERVING) and the processes are started again over the same weights
and pools, by the next step or by the supervisor thread between steps, whichever comes first; the requests
not in that step keep their pages and state. After MAX_REPLACEMENTS within REPLACEMENT_WINDOW_S it gives
up: the worker stays NOT_SERVING and must be restarted.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gpu_worker.model.loader import LoadedModel, load_model
from gpu_worker.runner.batch import Batch, ForwardOutput
from gpu_worker.runner.child_handle import ChildHandle, ModelProcessError
from gpu_worker.runner.messages import (
    PROTOCOL_VERSION,
    Failed,
    MasksReady,
    Ready,
    Step,
    StepDone,
    StepTables,
    TableWriter,
    Warm,
    WarmUp,
    encode_step,
    has_masked_rows,
    joined_logits,
    joined_output,
    masked_slots,
    step_logits,
    step_output,
    table_mask_words,
)
from gpu_worker.runner.pool_plan import PoolPlan, RunnerFacts
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.sampling import EMPTY_OUTPUT, StepOutput, StepSampling
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.shared_memory import SharedArena, share_weights
from gpu_worker.runner.speculation import masked_draft_counts
from gpu_worker.runner.step_split import Split
from gpu_worker.runner.token_masks import draft_mask_rows
from gpu_worker.runner.tuning import usable_cores
from gpu_worker.runner.warmup import WarmupTimes, scratch_steps
from hybridserve.errors import InvalidArgumentError

log = logging.getLogger("hybridserve.worker.model_process")
START_TIMEOUT_S = 600.0  # loading and (on a cold cache) nothing else: the decode compile runs in the background
WARM_UP_TIMEOUT_S = 1800.0  # the warm-up waits for the decode compile: a cold inductor cache on a busy machine
MODEL_PROCESS_MODES = ("auto", "on", "off")

SUPERVISE_INTERVAL_S = 0.25  # how often the supervisor looks for a dead model process between steps
MAX_REPLACEMENTS = 5  # dead model processes replaced within REPLACEMENT_WINDOW_S before the worker gives up
REPLACEMENT_WINDOW_S = 600.0


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
    on auto is the processes' threads together, or the cores but one where that is more. A --cpu-threads
    set by hand also sets the decode steps' threads where those are on auto (tuning.decode_threads)."""
    count = config.model_processes or (2 if usable_cores() >= 2 else 1)
    if count > 1 and config.cpu_threads and not config.cpu_decode_threads:  # set by hand: decode steps too
        config = replace(config, cpu_decode_threads=config.cpu_threads)
    if count > 1 and config.cpu_threads == 0:
        config = replace(config, cpu_threads=max(1, (usable_cores() - 1) // count))
    if count > 1 and config.model_process_lone_threads == 0:  # a step one computes alone: the others' cores too
        lone = max(count * (config.cpu_threads or 1), usable_cores() - 1)
        config = replace(config, model_process_lone_threads=lone)
    return count, config


class ProcessRunner(RunnerFacts):
    """A Runner (gpu_worker.runner.protocol) whose forward and sampling run in model processes. Not
    thread-safe: one engine thread calls `execute` (the supervisor thread only replaces dead processes,
    under the same lock)."""

    def __init__(self, loaded: LoadedModel, config: RunnerConfig) -> None:
        self.loaded = loaded
        self.device = loaded.device
        plan = PoolPlan.of(loaded, config)
        count, child_config = resolve_processes(config)
        self._arena = SharedArena("hybridserve-pool")  # kept open: a replacement process maps it too
        self._set_plan(plan, plan.build(self._arena.zeros))
        # 1 while a model process computes its part of a step: set here before the parts go out, cleared by
        # the process when done (the others may then take its cores: StepThreads.widen)
        self._busy = self._arena.zeros((count,), torch.int32).numpy()
        self._tables = TableWriter(StepTables(
            self.state_pool.num_slots, self.kv_pool.num_pages, loaded.config.vocab_size,
            self.kv_pool.page_size_tokens, self._arena.zeros, table_mask_words(loaded), config.num_draft_rows,
        ))  # fmt: skip
        self._weights = SharedArena("hybridserve-weights")
        self._weight_names = share_weights(loaded.model, self._weights)  # one copy, whatever the processes
        self._context = multiprocessing.get_context("spawn")  # never fork a process that runs torch threads
        self._child_config = child_config
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._children: list[ChildHandle] = []
        self._alive = False
        self._warming_up = False  # warm_up waits for the children
        self._replacements: list[float] = []  # when dead model processes were replaced (monotonic)
        self.gave_up: str | None = None  # why no more replacements are tried
        try:
            self._describe: dict[str, Any] = self._start_children(count)
        except BaseException:
            self.close()
            raise
        self._split = Split(len(self._children), config.model_process_split_min_tokens)
        self._alive = True
        self.steps_here = 0  # steps run in this process (fewer rows than min_rows)
        self.steps_there = 0  # steps run in the model process(es)
        self.steps_shared = 0  # of those, steps shared among several model processes
        self.lone_parts = 0  # parts of steps run (at least from some block on) on the idle processes' cores too
        self.replaced = 0  # model processes replaced after they died
        # What torch work stays here (the prefix cache's copies, small steps) is small: one thread, so that
        # no OpenMP thread of this process spins on the core the model runs on.
        torch.set_num_threads(1)
        self.min_rows = config.model_process_min_rows
        self._local: ModelRunner | None = None
        if self.min_rows > 0:  # small steps here, eagerly, on one thread, over the same pools
            local_config = replace(
                config,
                cpu_threads=1,
                cpu_prefill_threads=0,
                cpu_decode_threads=1,
                decode_compile="off",
                compile_step_sizes="",
            )
            self._local = ModelRunner(loaded, local_config, pools=(self.kv_pool, self.state_pool))
        else:
            _strip_weights(loaded.model)  # the children map the shared copy
        self._supervisor = threading.Thread(target=self._supervise, name="model-process-supervisor", daemon=True)
        self._supervisor.start()
        pids = ", ".join(str(c.pid) for c in self._children)
        log.info("model process %s ready" if len(self._children) == 1 else "model processes %s ready", pids)

    def _start_children(self, count: int) -> dict[str, Any]:
        """Starts `count` model processes and waits for them to load; returns the first one's description."""
        children = []
        try:
            for index in range(count):
                children.append(ChildHandle.start(
                    self._context, index, count, self.loaded, self._child_config, self._arena, self._weights,
                    self._weight_names,
                ))  # fmt: skip
            replies = [child.receive(START_TIMEOUT_S) for child in children]
        except BaseException:
            for child in children:
                child.stop()
            raise
        failed = [r for r in replies if not isinstance(r, Ready)]
        if failed or any(r.version != PROTOCOL_VERSION for r in replies):
            for child in children:
                child.stop()
            why = failed[0].message if failed and isinstance(failed[0], Failed) else f"protocol {replies}"
            raise ModelProcessError(f"the model process did not start: {why}")
        self._children = children
        first = replies[0]
        assert isinstance(first, Ready)
        return first.describe

    # ---- liveness and replacement ------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """The model processes run (checked each step and by the worker's liveness probe)."""
        return self._alive and all(c.process.is_alive() for c in self._children)

    def is_alive(self) -> bool:
        return self.alive

    def _supervise(self) -> None:
        """Replaces model processes that died between steps (a step that finds one dead replaces it itself)."""
        while not self._closed.wait(SUPERVISE_INTERVAL_S):
            if not self.alive and self.gave_up is None and not self._warming_up:
                with self._lock:
                    if not self._closed.is_set():
                        self._replace_dead()

    def _replace_dead(self) -> None:
        """Under the lock: when a model process is gone, stops them all (a survivor may hold a step's reply
        nobody will read) and starts as many again over the same weights and pools. The requests of the
        step it died in have failed already; every other request's pages and state are in shared memory,
        untouched. Gives up after MAX_REPLACEMENTS within REPLACEMENT_WINDOW_S."""
        if self.alive or self.gave_up is not None:
            return
        now = time.monotonic()
        self._replacements = [t for t in self._replacements if now - t < REPLACEMENT_WINDOW_S]
        codes = [c.process.exitcode for c in self._children]
        if len(self._replacements) >= MAX_REPLACEMENTS:
            self.gave_up = (
                f"the model process died {MAX_REPLACEMENTS + 1} times within {REPLACEMENT_WINDOW_S:.0f} s "
                f"(exit codes {codes}); restart the worker"
            )
            log.error("%s", self.gave_up)
            return
        self._replacements.append(now)
        self._alive = False
        log.error("a model process is gone (exit codes %s); starting %d again", codes, len(self._children))
        count = len(self._children)
        for child in self._children:
            child.stop()
        self._children = []
        started = time.monotonic()
        try:
            self._describe = self._start_children(count)
        except Exception as exc:
            log.error("replacing the model processes failed: %s", exc)
            return  # tried again by the supervisor, within the limit
        self._busy[:] = 0
        self._tables = TableWriter(self._tables.tables)  # the new processes read every table afresh
        self._alive = True
        self.replaced += count
        log.warning("model processes %s replaced in %.1f s", ", ".join(str(c.pid) for c in self._children),
                    time.monotonic() - started)  # fmt: skip

    def _usable(self) -> None:
        """Under the lock, before a step: replaces dead processes, or raises ModelProcessError."""
        if not self.alive:
            self._replace_dead()
        if not self.alive:
            raise ModelProcessError(self.gave_up or "the model process is gone and could not be started again")

    @property
    def pid(self) -> int | None:
        """The first model process's (there may be several: `pids`)."""
        return self._children[0].pid if self._children else None

    @property
    def pids(self) -> list[int | None]:
        return [c.pid for c in self._children]

    @property
    def traffic(self) -> tuple[int, int]:
        """Bytes sent to and received from the model processes since they started (pipe payloads)."""
        return sum(c.bytes_sent for c in self._children), sum(c.bytes_received for c in self._children)

    # ---- steps -------------------------------------------------------------------------------------
    def runs_elsewhere(self, batch: Batch) -> bool:
        """Whether `batch` goes to the model process (then `execute`'s while_waiting runs while it computes,
        and the engine plans there)."""
        return self._local is None or len(batch.sequences) >= self.min_rows

    def execute(
        self, batch: Batch, sampling: StepSampling, while_waiting: Callable[[], None] | None = None
    ) -> StepOutput:
        """The step in the model processes: the same tokens, the same pool updates as in process. A step of
        fewer than `min_rows` rows runs here instead: too small for the hand-off to pay."""
        return self._run(batch, sampling, while_waiting, want_logits=False)[0]

    def forward(self, batch: Batch, while_waiting: Callable[[], None] | None = None) -> ForwardOutput:
        """ModelRunner.forward in the model processes, the logits sent back (tests and tools: a served step
        uses `execute`, which returns only tokens)."""
        out = self._run(batch, StepSampling(), while_waiting, want_logits=True)[1]
        assert out is not None
        return out

    def _run(
        self, batch: Batch, sampling: StepSampling, while_waiting: Callable[[], None] | None, want_logits: bool
    ) -> tuple[StepOutput, ForwardOutput | None]:
        with self._lock:
            self._usable()
            if self._local is not None and not self.runs_elsewhere(batch):
                self.steps_here += 1
                if want_logits:
                    return EMPTY_OUTPUT, self._local.forward(batch, while_waiting)
                return self._local.execute(batch, sampling, while_waiting), None
            self.steps_there += 1
            parts = self._split.assign(batch)
            self._tables.publish(batch, sampling)
            steps = [encode_step(batch, None if len(parts) == 1 else p, sampling, want_logits) for p in parts]
            self._busy[: len(steps)] = 1
            try:
                for child, step in zip(self._children, steps, strict=False):
                    child.send(step)
                mask_error = self._send_masks(batch, sampling, steps)
                if while_waiting is not None:
                    while_waiting()
                replies = [child.receive(None) for child, _ in zip(self._children, steps, strict=False)]
            except (OSError, EOFError, ModelProcessError, pickle.UnpicklingError) as exc:
                self._alive = False
                codes = [c.process.exitcode for c in self._children]
                for child in self._children:
                    child.process.kill()  # replaced before the next step
                raise ModelProcessError(
                    f"the model process is gone (exit codes {codes}); this step's requests are lost, and the"
                    " process is being replaced"
                ) from exc
        if mask_error is not None:  # the processes sampled with every token allowed: the step's tokens are lost
            raise RuntimeError(f"building the token masks failed: {mask_error}") from mask_error
        done: list[StepDone] = []
        for reply in replies:
            if isinstance(reply, Failed) and reply.invalid:
                raise InvalidArgumentError(reply.message)
            if isinstance(reply, Failed):
                raise RuntimeError(f"model process: {reply.message}")
            assert isinstance(reply, StepDone)
            done.append(reply)
        self._describe["decode_compile"] = done[0].compile_status
        self.lone_parts += sum(1 for r in done if r.widened)
        if len(parts) == 1:
            return step_output(done[0]), step_logits(done[0]) if want_logits else None
        self.steps_shared += 1
        self._split.learn(batch, parts, [r.seconds for r in done])
        return joined_output(parts, done, sampling), joined_logits(parts, done) if want_logits else None

    def _send_masks(self, batch: Batch, sampling: StepSampling, steps: list[Step]) -> Exception | None:
        """While the model processes compute: the constrained rows' masks into the tables, then `MasksReady`
        to each process whose part has masked rows. A failure to build them is returned (the processes
        still get their `MasksReady`, over masks that allow every token, so that the step ends in order)."""
        if sampling.masks is None:
            return None
        tables = self._tables.tables
        masks, error = tables.masks, None
        slots = masked_slots(batch, sampling)
        try:
            before = draft_mask_rows(masked_draft_counts(batch, sampling), tables.num_slots, tables.draft_mask_rows)
            sampling.masks.fill(masks, slots, before)
        except Exception as exc:
            masks[slots] = -1
            error = exc
        for child, step in zip(self._children, steps, strict=False):
            if has_masked_rows(step):
                child.send(MasksReady())
        return error

    def warm_up(self) -> WarmupTimes:
        """ModelRunner.warm_up in every model process, one after the other on the same scratch pages and
        slots (their background compiles and kernel builds have run side by side since they started),
        and in the worker's own runner for small steps when there is one."""
        times = WarmupTimes()
        with self._lock, scratch_steps(self.kv_pool, self.state_pool, self.config.vocab_size) as steps:
            self._usable()
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
                child.send(WarmUp(steps))
                reply = child.receive(WARM_UP_TIMEOUT_S)
            except (OSError, EOFError, ModelProcessError) as exc:
                self._alive = False
                raise ModelProcessError("the model process is gone during its warm-up; restart the worker") from exc
            if not isinstance(reply, Warm):
                raise RuntimeError(f"model process warm-up: {getattr(reply, 'message', reply)}")
            times = times.beside(reply.times)
        self._describe["decode_compile"] = times.compile_status
        return times

    def describe(self) -> dict[str, int | str]:
        return {
            **self._describe, "model_process": self.pid or 0, "model_processes": len(self._children),
            "model_processes_replaced": self.replaced,
        }  # fmt: skip

    def close(self) -> None:
        """Stops the children (at shutdown); idempotent."""
        self._alive = False
        closed = getattr(self, "_closed", None)
        if closed is not None:
            closed.set()
        local = getattr(self, "_local", None)  # absent when the start failed
        if local is not None:
            local.close()
        for child in getattr(self, "_children", []):
            if getattr(self, "_warming_up", False):  # busy till warm (minutes, compiling): "stop" would wait
                child.process.kill()
            child.stop()
        for arena in (getattr(self, "_arena", None), getattr(self, "_weights", None)):
            if arena is not None:
                arena.close()


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
