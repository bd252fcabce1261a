"""The engine's own cost per step, with a null runner (no model): what a GPU step of a small model
pays outside its forward pass. N requests decode steadily (N = 64, 256, 1,024 by default); each
step's wall time is split into the engine thread's parts:

    snapshot  the scheduler's view of every request (StepInput) for the next plan
    plan      the part of the PlanStep round trip the engine waited for (with asynchronous
              scheduling the round trip runs on the planner thread, overlapped with the step)
    prepare   allocation and the batch's rows
    flush     the last step's stream events handed to their queues, at the start of the forward
              (the runner calls back before it computes; on a GPU, before its kernels go)
    forward   the null runner's execute (its logits, no model, and their sampling: greedy, in the runner
              as on a device), less the flush
    sample    the step's sampling input (StepSampling: which rows sample, with which params)
    apply     each token to its request, its stream event queued
    emit      the step record to the observers
    between   from the end of a step's emit to the start of the next step: the loop's work between steps
              (new requests and aborts, deadlines)
`own` is outside the forward less the plan wait, plus between: the engine thread's own parts, what a
step costs with planning fully overlapped (behind a forward longer than the round trip). And, beside it,
`stream`: the time a consumer thread spends turning the queued events into GenerateResponse
messages (the worker's stream threads), per step, and the full round trip of the plan (`rtt`),
overlapped or not. The scheduler is the real service in its own process, over gRPC.

    .venv/bin/python bench/bench_engine.py [--requests 64,256,1024] [--steps 60] [--sync] [--forward-ms 0,3]
        [--forms columns,rows]

`--forms columns,rows` measures each size twice: with PlanStep's columns form (the worker's, planned
by the scheduler's steady-decode path) and with its rows form (one message per request, planned by
plan_step): what removing the columns form and core/steady.py would cost.

`--forward-ms X` makes the null forward take X ms of wall time (a sleep, the CPU left free as by a
GPU forward): with X longer than the round trip the `plan` column (the wait) should be about 0.

Target: at most 1 ms per step at 256 requests outside the forward pass, planning
overlapped. Only figures from one run, side by side, mean anything.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from gpu_worker.api.service import output_to_pb
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.observer import EngineObserver
from gpu_worker.engine.records import StepRecord
from gpu_worker.engine.request import GenerationParams, Request, StopChecker
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.model.tokenizer import Tokenizer, build_byte_tokenizer
from gpu_worker.runner.batch import Batch, ForwardOutput
from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.protocol import LogitsRunner, PoolSet
from gpu_worker.runner.sampling import SamplingParams
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.state_pool import MambaStatePool
from gpu_worker.runner.tuning import freeze_startup_objects, set_cpu_threads
from hybridserve_cli.stack import Stack
from scheduler_svc import convert
from scheduler_svc.client import SchedulerClient
from scheduler_svc.core import MambaCacheMode, SchedulerConfig, StepInput, StepPlan

PAGE = 16
VOCAB = 256
PROMPT = 16
PARTS = ("snapshot", "plan", "prepare", "flush", "forward", "sample", "apply", "emit")
TOKENIZER = Tokenizer(build_byte_tokenizer())


class NullRunner(LogitsRunner):
    """Real page and slot pools (no layers); forward returns fixed logits, one row per sequence,
    after `forward_s` seconds of sleep (0: at once)."""

    def __init__(self, num_pages: int, max_num_seqs: int, forward_s: float = 0.0) -> None:
        cpu = torch.device("cpu")
        self.forward_s = forward_s  # the forward's wall time: a sleep, as a GPU forward leaves the CPU free
        self.while_waiting_s = 0.0  # the engine's callback at the start of each forward, summed
        self.kv_pool = KVPagePool(num_pages, PAGE, 0, 1, 1, torch.float32, cpu)
        self.state_pool = MambaStatePool(max_num_seqs, 0, 0, (1, 1), (1, 1, 1), torch.float32, cpu)
        self.pools = PoolSet(self.kv_pool, self.state_pool, 0, 0, torch.device("cpu"))
        self.eos_token_ids = (2,)
        self._logits = torch.zeros(max_num_seqs, VOCAB)
        self._logits[:, 65] = 1.0

    def forward(self, batch: Batch, while_waiting: Callable[[], None] | None = None) -> ForwardOutput:
        if while_waiting is not None:
            started = time.perf_counter()
            while_waiting()
            self.while_waiting_s += time.perf_counter() - started
        if self.forward_s:
            time.sleep(self.forward_s)
        return ForwardOutput(logits=self._logits[: len(batch.sequences)])


class Steps(EngineObserver):
    """The figures of each step, not the records: keeping every record (and its snapshot) alive would
    make each full garbage collection walk them, a cost of the benchmark and not of the engine."""

    def __init__(self) -> None:
        self.records: list[tuple[float, float, float, int, float]] = []  # plan wait, plan rtt, wall, rows, end

    def step_finished(self, record: StepRecord) -> None:
        self.records.append(
            (record.plan_wait_s, record.plan_latency_s, record.wall_s, len(record.served), record.end_time_s)
        )


def timed(engine: Engine, name: str, totals: dict[str, float], part: str, exits: list[float] | None = None) -> None:
    """Wraps an engine method so that its time on the engine thread adds up in totals[part] (and the
    monotonic time of each return goes to `exits`)."""
    original: Callable[..., Any] = getattr(engine, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        on_engine = threading.current_thread().name == "engine"
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if on_engine:
                totals[part] += time.perf_counter() - started
                if exits is not None:
                    exits.append(time.monotonic())

    setattr(engine, name, wrapper)


def make_request(i: int) -> Request:
    return Request(
        request_id=f"r{i}", prompt_token_ids=[3 + (i + j) % 50 for j in range(PROMPT)],
        params=GenerationParams(SamplingParams(), 1 << 20, (), True), arrival_time=time.monotonic(),
        deadline=None, stop_checker=StopChecker(TOKENIZER, ()),
    )  # fmt: skip


def drain_streams(requests: list[Request], stop: threading.Event, counted: dict[str, float]) -> None:
    """The stream threads' work, in one thread: every queued event becomes a GenerateResponse. The
    queues are polled with empty() (a worker's stream threads block on theirs): a get_nowait on an
    empty queue raises, and 256 raises every poll took the GIL from the engine thread."""
    while not stop.is_set():
        busy = 0.0
        for r in requests:
            events = r.events
            while not events.empty():  # only this thread takes from the queues: empty() is exact
                event = events.get_nowait()
                started = time.perf_counter()
                output_to_pb(r.request_id, event)
                busy += time.perf_counter() - started
        counted["stream"] += busy
        time.sleep(0.0005)


def rows_plan(client: SchedulerClient) -> Callable[[StepInput], StepPlan]:
    """PlanStep in its rows form: the request states one message each, and the scheduler plans with
    plan_step (its steady-decode path takes columns only): the round trip without the columns form."""
    return lambda step: convert.plan_from_pb(client.plan_pb(convert.step_to_pb(step)))


def measure(
    num_requests: int, steps: int, scheduler: str, async_scheduling: bool, forward_s: float = 0.0, form: str = "columns"
) -> dict[str, float]:
    """Per-step milliseconds of each part over `steps` steady decode steps of num_requests requests."""
    config = SchedulerConfig(
        max_num_batched_tokens=max(2048, num_requests), max_num_seqs=num_requests, block_size=256,
        mamba_block_size=64, mamba_cache_mode=MambaCacheMode.ALIGN, kv_page_size=PAGE,
    )  # fmt: skip
    num_pages = num_requests * (2 + (PROMPT + 4 * steps) // PAGE)
    runner = NullRunner(num_pages, num_requests, forward_s)
    settings = EngineSettings(
        scheduler=config, runner=RunnerConfig(kv_page_size_tokens=PAGE, max_num_seqs=num_requests),
        scheduler_addresses=(scheduler,), async_scheduling=async_scheduling, max_queue_len=num_requests + 1,
    )  # fmt: skip
    client = SchedulerClient((scheduler,), deadline_s=10.0, give_up_after_s=30.0)
    log = Steps()
    plan = client.plan if form == "columns" else rows_plan(client)
    engine = Engine(runner, plan, settings, observer=log)  # type: ignore[arg-type]
    totals: dict[str, float] = defaultdict(float)
    for name, part in (("_snapshot", "snapshot"), ("_prepare", "prepare"), ("_execute", "forward"),
                       ("_sampling", "sample"), ("_apply", "apply")):  # fmt: skip
        timed(engine, name, totals, part)
    emitted: list[float] = []  # when each step's _emit returned, one per record
    timed(engine, "_emit", totals, "emit", emitted)
    requests = [make_request(i) for i in range(num_requests)]
    stop = threading.Event()
    streamed: dict[str, float] = defaultdict(float)
    consumer = threading.Thread(target=drain_streams, args=(requests, stop, streamed), daemon=True)
    freeze_startup_objects()  # as the worker does before serving
    engine.start()
    consumer.start()
    try:
        for r in requests:
            engine.submit(r)
        warm = -(-num_requests * PROMPT // config.max_num_batched_tokens) + 5
        while len(log.records) < warm:
            time.sleep(0.01)
        first = len(log.records)
        before, stream_before, flush_before = dict(totals), streamed["stream"], runner.while_waiting_s
        while len(log.records) < first + steps + 1:
            time.sleep(0.005)
        records = log.records[first : first + steps]
        following = log.records[first + 1 : first + steps + 1]
        emit_ends = emitted[first : first + steps]
        after, stream_after, flush_after = dict(totals), streamed["stream"], runner.while_waiting_s
    finally:
        for r in requests:
            engine.abort(r.request_id)
        engine.stop()
        stop.set()
        consumer.join(5)
        client.close()
    n = len(records)
    out = {part: (after.get(part, 0.0) - before.get(part, 0.0)) / n * 1e3 for part in PARTS if part != "plan"}
    out["flush"] = (flush_after - flush_before) / n * 1e3
    out["forward"] -= out["flush"]
    out["plan"] = sum(r[0] for r in records) / n * 1e3
    out["rtt"] = sum(r[1] for r in records) / n * 1e3
    out["wall"] = sum(r[2] for r in records) / n * 1e3
    out["stream"] = (stream_after - stream_before) / n * 1e3
    out["outside"] = out["wall"] - out["forward"]
    # From a step's emit to the next one's start: the loop's work between steps (the inbox, deadlines).
    out["between"] = sum((f[4] - f[2]) - e for e, f in zip(emit_ends, following, strict=True)) / n * 1e3
    out["own"] = out["outside"] - out["plan"] + out["between"]  # the engine thread's, planning overlapped
    out["decodes"] = sum(r[3] for r in records) / n
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="64,256,1024", help="running requests, comma-separated")
    parser.add_argument("--steps", type=int, default=60, help="steady decode steps measured per size")
    parser.add_argument("--sync", action="store_true", help="also measure with asynchronous scheduling off")
    parser.add_argument(
        "--forward-ms", default="0", help="the null forward's wall time (a sleep), comma-separated: a GPU decode"
        " step of a small model takes a few ms, and planning and the streams should hide behind it",
    )  # fmt: skip
    parser.add_argument(
        "--forms", default="columns", help="PlanStep's request-state forms, comma-separated: columns (the"
        " worker's, with the scheduler's steady-decode path), rows (one message per request, plan_step)",
    )  # fmt: skip
    parser.add_argument(
        "--cpu-threads", type=int, default=0, help="torch's intra-op threads for the engine's own torch calls"
        " (sampling of the null logits); 0 = the worker's default on CPU",
    )  # fmt: skip
    args = parser.parse_args()
    set_cpu_threads(args.cpu_threads)
    with Stack(start_timeout_s=60.0) as stack:
        address = stack.scheduler()
        modes = [True, False] if args.sync else [True]
        cols = ("wall", "outside", "own", *PARTS, "between", "stream", "rtt")
        print(
            "ms per step (engine thread); outside = wall - forward; own = outside - plan + between;"
            " plan = wait for it; rtt = PlanStep round trip"
        )
        print(f"{'requests':>9}{'async':>7}{'form':>8}" + "".join(f"{c:>10}" for c in cols))
        for forward_ms in (float(x) for x in args.forward_ms.split(",")):
            for n in (int(x) for x in args.requests.split(",")):
                for mode in modes:
                    for form in args.forms.split(","):
                        m = measure(n, args.steps, address, mode, forward_ms / 1e3, form)
                        row = f"{n:>9}{'on' if mode else 'off':>7}{form:>8}" + "".join(f"{m[c]:>10.3f}" for c in cols)
                        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
