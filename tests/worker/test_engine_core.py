"""The engine on its own: the pure planner passed in directly and a fake runner whose next token
depends only on a chunk's last token (no gRPC, no model). Asserts on the step records and request
events the engine emits: async scheduling on and off, preemption, abort, deadline, stop strings,
EOS, a failed forward and an unreachable scheduler."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.observer import EngineObserver
from gpu_worker.engine.records import Occupancy, RequestFinished, StepRecord
from gpu_worker.engine.request import FinishReason, GenerationParams, Request, RequestOutput, StopChecker
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.model.tokenizer import Tokenizer, build_byte_tokenizer
from gpu_worker.runner.batch import Batch, ForwardOutput
from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.protocol import LogitsRunner, PoolSet
from gpu_worker.runner.sampling import SamplingParams
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.state_pool import MambaStatePool
from hybridserve.errors import DeadlineExceededError, HybridServeError, ResourceExhaustedError, UnavailableError
from scheduler_svc.core import MambaCacheMode, SchedulerConfig, StepInput, StepPlan, plan_step

TOKENIZER = Tokenizer(build_byte_tokenizer())
EOS = 2  # the byte tokenizer's <|eos|>
CYCLE = TOKENIZER.encode("abcdefgh")  # the fake model writes "abcdefghabcdefgh..."
PAGE = 4  # tokens per KV page
CONFIG = SchedulerConfig(
    max_num_batched_tokens=32, max_num_seqs=4, long_prefill_token_threshold=0, max_num_prefill_tokens_per_step=16,
    block_size=16, mamba_block_size=8, mamba_cache_mode=MambaCacheMode.ALIGN, kv_page_size=PAGE,
)  # fmt: skip


def next_token(last: int, eos_after: int | None) -> int:
    """The fake model: the letter after `last` in CYCLE ('a' after anything else); EOS instead of
    the letter after `eos_after`."""
    if eos_after is not None and last == eos_after:
        return EOS
    return CYCLE[(CYCLE.index(last) + 1) % len(CYCLE)] if last in CYCLE else CYCLE[0]


def expected_tokens(num: int) -> list[int]:
    return [CYCLE[i % len(CYCLE)] for i in range(num)]


class FakeRunner(LogitsRunner):
    """Real page and slot pools (no layers), a forward that checks each chunk continues its state
    slot where the last one ended, and logits that pick next_token()."""

    def __init__(self, num_pages: int, eos_after: int | None = None, fail_on_call: int | None = None) -> None:
        cpu = torch.device("cpu")
        self.kv_pool = KVPagePool(num_pages, PAGE, 0, 1, 1, torch.float32, cpu)
        self.state_pool = MambaStatePool(CONFIG.max_num_seqs, 0, 0, (1, 1), (1, 1, 1), torch.float32, cpu)
        self.pools = PoolSet(self.kv_pool, self.state_pool, 0, 0, torch.device("cpu"))
        self.eos_token_ids = (EOS,)
        self.eos_after = eos_after
        self.fail_on_call = fail_on_call
        self.delay_s = 0.0
        self.num_calls = 0
        self._slot_positions: dict[int, int] = {}

    def forward(self, batch: Batch, while_waiting: Callable[[], None] | None = None) -> ForwardOutput:
        if while_waiting is not None:
            while_waiting()
        self.num_calls += 1
        if self.num_calls == self.fail_on_call:
            raise RuntimeError("device lost")
        time.sleep(self.delay_s)
        logits = torch.full((len(batch.sequences), 300), -30.0)
        for row, seq in enumerate(batch.sequences):
            end = seq.start_pos + len(seq.token_ids)
            assert len(seq.page_ids) * PAGE >= end, "the page table does not cover the chunk"
            assert seq.start_pos == 0 or self._slot_positions.get(seq.state_slot) == seq.start_pos, "state gap"
            self._slot_positions[seq.state_slot] = end
            logits[row, next_token(seq.token_ids[-1], self.eos_after)] = 30.0
        return ForwardOutput(logits=logits)


class Log(EngineObserver):
    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.finished: dict[str, RequestFinished] = {}
        self.occupancy: list[Occupancy] = []

    def step_finished(self, record: StepRecord) -> None:
        self.steps.append(record)

    def request_finished(self, event: RequestFinished) -> None:
        self.finished[event.request_id] = event

    def occupancy_changed(self, occupancy: Occupancy) -> None:
        self.occupancy.append(occupancy)


def request(rid: str, prompt_len: int, max_tokens: int, stop: tuple[str, ...] = (), ignore_eos: bool = True,
            deadline_s: float | None = None) -> Request:  # fmt: skip
    now = time.monotonic()
    return Request(
        request_id=rid,
        prompt_token_ids=[3 + (i * 7) % 50 for i in range(prompt_len)],  # ids below the letters a..h
        params=GenerationParams(SamplingParams(), max_tokens, stop, ignore_eos),
        arrival_time=now,
        deadline=None if deadline_s is None else now + deadline_s,
        stop_checker=StopChecker(TOKENIZER, stop),
    )


def stream(req: Request, timeout_s: float = 20.0) -> list[RequestOutput]:
    """Every event of a request, up to its last."""
    events = [req.events.get(timeout=timeout_s)]
    while events[-1].finish_reason is None and events[-1].error is None:
        events.append(req.events.get(timeout=timeout_s))
    return events


def tokens_of(events: list[RequestOutput]) -> list[int]:
    return [t for e in events for t in e.token_ids]


@pytest.fixture
def start_engine() -> Callable[..., tuple[Engine, FakeRunner, Log]]:
    engines: list[Engine] = []

    def start(runner: FakeRunner, plan: Callable[[StepInput], StepPlan] = plan_step, **settings: object):
        runner_config = RunnerConfig(kv_page_size_tokens=PAGE, max_num_seqs=CONFIG.max_num_seqs)
        engine_settings = replace(
            EngineSettings(scheduler=CONFIG, runner=runner_config, scheduler_addresses=("in-process",)), **settings
        )
        log = Log()
        engine = Engine(runner, plan, engine_settings, observer=log)  # type: ignore[arg-type]
        engine.start()
        engines.append(engine)
        return engine, runner, log

    yield start
    for engine in engines:
        engine.stop()


def assert_drained(log: Log, runner: FakeRunner) -> None:
    """After the last request ended: nothing runs, waits or holds a page or a slot."""
    last = log.steps[-1].occupancy
    assert (last.num_running, last.num_waiting, last.num_kv_pages_used, last.num_state_slots_used) == (0, 0, 0, 0)
    assert runner.kv_pool.num_free_pages == runner.kv_pool.num_pages
    assert runner.state_pool.num_free_slots == runner.state_pool.num_slots


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_every_token_is_computed_once_and_recorded(start_engine, async_scheduling):
    engine, runner, log = start_engine(FakeRunner(num_pages=256), async_scheduling=async_scheduling)
    jobs = {f"r{i}": (5 + 9 * i, 6 + 3 * i) for i in range(5)}  # prompt tokens, max_tokens
    requests = {rid: request(rid, *job) for rid, job in jobs.items()}
    for r in requests.values():
        engine.submit(r)
    outputs = {rid: stream(r) for rid, r in requests.items()}

    for rid, (prompt_len, max_tokens) in jobs.items():
        assert tokens_of(outputs[rid]) == expected_tokens(max_tokens)
        last = outputs[rid][-1]
        assert last.finish_reason is FinishReason.LENGTH
        assert (last.prompt_tokens, last.completion_tokens) == (prompt_len, max_tokens)
        assert log.finished[rid].reason is FinishReason.LENGTH
        served = [s for step in log.steps for s in step.served if s.request_id == rid]
        assert sum(s.num_tokens for s in served if s.is_prefill) == prompt_len
        assert sum(s.num_tokens for s in served if not s.is_prefill) == max_tokens - 1
        assert sum(s.sampled for s in served) == max_tokens
        assert [s.num_output_tokens for s in served if s.sampled] == list(range(1, max_tokens + 1))
    assert [s.step_index for s in log.steps] == list(range(len(log.steps)))
    assert all(s.step_input is not None and s.step_input.step_index == s.step_index for s in log.steps)
    assert all(s.num_computed_tokens <= CONFIG.max_num_batched_tokens for s in log.steps)
    assert engine.counters.num_steps == len(log.steps)
    assert engine.counters.num_generated_tokens == sum(max_tokens for _, max_tokens in jobs.values())
    assert_drained(log, runner)


def test_preemption_under_a_small_page_pool_keeps_outputs(start_engine):
    engine, runner, log = start_engine(FakeRunner(num_pages=14))  # 56 tokens of KV for 3 x 28
    requests = [request(f"p{i}", 12, 16) for i in range(3)]
    for r in requests:
        engine.submit(r)
    outputs = [stream(r) for r in requests]

    assert all(tokens_of(events) == expected_tokens(16) for events in outputs)
    preempted = [rid for step in log.steps for rid in step.preempted_request_ids]
    assert preempted, "the pool was meant to force preemption"
    assert engine.counters.num_preemptions == len(preempted)
    for rid in set(preempted):  # a preempted request recomputes from position 0
        prefill = sum(s.num_tokens for step in log.steps for s in step.served if s.request_id == rid and s.is_prefill)
        assert prefill > 12
    assert_drained(log, runner)


def test_abort_ends_the_stream_and_frees_everything(start_engine):
    engine, runner, log = start_engine(FakeRunner(num_pages=256))
    runner.delay_s = 0.002
    r = request("a", 10, 500)
    engine.submit(r)
    first = r.events.get(timeout=10)
    assert first.token_ids and first.finish_reason is None
    assert engine.abort("a")
    events = stream(r)
    assert events[-1].finish_reason is FinishReason.ABORT
    assert events[-1].completion_tokens == 1 + len(tokens_of(events))
    assert log.finished["a"].reason is FinishReason.ABORT and log.finished["a"].error is None
    assert not engine.abort("a"), "an ended request is unknown"
    deadline = time.monotonic() + 5
    while not (log.occupancy and log.occupancy[-1].num_running == 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert log.occupancy[-1] == replace(log.occupancy[-1], num_running=0, num_kv_pages_used=0, num_state_slots_used=0)


def test_a_passed_deadline_fails_the_request_mid_generation(start_engine):
    engine, runner, log = start_engine(FakeRunner(num_pages=512))
    runner.delay_s = 0.002
    r = request("late", 10, 1000, deadline_s=0.5)
    engine.submit(r)
    events = stream(r)
    assert isinstance(events[-1].error, DeadlineExceededError)
    assert 0 < len(tokens_of(events)) < 1000
    ended = log.finished["late"]
    assert ended.reason is FinishReason.ERROR and isinstance(ended.error, DeadlineExceededError)
    assert runner.kv_pool.num_free_pages == runner.kv_pool.num_pages


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_stop_string_cuts_the_text_and_ends_with_stop(start_engine, async_scheduling):
    engine, _, log = start_engine(FakeRunner(num_pages=256), async_scheduling=async_scheduling)
    r = request("s", 7, 40, stop=("def",))  # the stop string spans three tokens
    other = request("o", 9, 12)
    engine.submit(r)
    engine.submit(other)
    events = stream(r)
    assert "".join(e.text for e in events) == "abc"
    assert tokens_of(events) == expected_tokens(6)  # ... 'd', 'e', 'f' reached the stop string
    assert events[-1].finish_reason is FinishReason.STOP and events[-1].completion_tokens == 6
    assert tokens_of(stream(other)) == expected_tokens(12), "a batch mate is not affected"
    assert log.finished["s"].reason is FinishReason.STOP
    (last,) = [s for step in log.steps for s in step.served if s.request_id == "s" and s.num_output_tokens == 6]
    assert last.sampled


def test_eos_ends_with_eos_unless_ignored(start_engine):
    d = TOKENIZER.encode("d")[0]
    engine, runner, log = start_engine(FakeRunner(num_pages=256, eos_after=d))
    stops = request("eos", 5, 20, ignore_eos=False)
    ignores = request("ignore", 5, 20, ignore_eos=True)
    engine.submit(stops)
    engine.submit(ignores)
    events = stream(stops)
    assert tokens_of(events) == [*expected_tokens(4), EOS]
    assert "".join(e.text for e in events) == "abcd"
    assert events[-1].finish_reason is FinishReason.EOS and log.finished["eos"].reason is FinishReason.EOS
    assert stream(ignores)[-1].finish_reason is FinishReason.LENGTH
    assert_drained(log, runner)


def test_a_failed_forward_fails_its_requests_and_the_engine_goes_on(start_engine):
    engine, runner, log = start_engine(FakeRunner(num_pages=256, fail_on_call=2))
    doomed = request("doomed", 6, 10)
    engine.submit(doomed)
    error = stream(doomed)[-1].error
    assert isinstance(error, HybridServeError) and "device lost" in str(error)
    failed_step = next(s for s in log.steps if any(x.request_id == "doomed" for x in s.served) and s.step_index == 1)
    assert not any(s.sampled for s in failed_step.served)
    later = request("later", 6, 3)
    engine.submit(later)
    assert tokens_of(stream(later)) == expected_tokens(3)
    assert_drained(log, runner)


def test_no_scheduler_fails_every_live_request(start_engine):
    calls = threading.Event()

    def unreachable(step_input: StepInput) -> StepPlan:
        calls.set()
        raise UnavailableError("no scheduler answered for 0.0 s")

    engine, runner, log = start_engine(FakeRunner(num_pages=64), plan=unreachable)
    requests = [request(f"u{i}", 4, 4) for i in range(3)]
    for r in requests:
        engine.submit(r)
    for r in requests:
        assert isinstance(stream(r)[-1].error, UnavailableError)
    assert calls.is_set() and not log.steps
    assert {e.reason for e in log.finished.values()} == {FinishReason.ERROR}


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_request_that_can_never_fit_fails_as_the_plan_says(start_engine, async_scheduling):
    """A prompt longer than the whole KV pool: its first chunk fits, the next never will. The plan
    says to fail it (scheduler_svc/core/remedies.py) and the engine applies that; a later request is
    served as usual."""
    engine, runner, log = start_engine(FakeRunner(num_pages=4), async_scheduling=async_scheduling)
    r = request("r", 10 * PAGE, 10)  # 10 pages of prompt in a pool of 4
    engine.submit(r)
    error = stream(r)[-1].error
    assert isinstance(error, ResourceExhaustedError) and "cannot be scheduled" in str(error)
    failing = [s for s in log.steps if s.plan.failed_request_ids]
    assert [s.plan.failed_request_ids for s in failing] == [("r",)]
    assert not failing[0].plan.slices and not failing[0].served
    assert not [s for s in log.steps if not s.plan.slices and not s.plan.failed_request_ids], "no empty plan"
    assert log.finished["r"].reason is FinishReason.ERROR
    later = request("later", 6, 3)
    engine.submit(later)
    assert tokens_of(stream(later)) == expected_tokens(3)
    assert_drained(log, runner)


def test_an_empty_plan_with_live_requests_does_not_spin_the_engine(start_engine):
    """The planner never returns one; should a scheduler do so anyway, the engine decides nothing
    in its place: it waits a moment before it plans again, and the request stays live (abortable)."""
    calls = 0

    def stuck(step_input: StepInput) -> StepPlan:
        nonlocal calls
        calls += 1
        plan = plan_step(step_input)
        return plan if step_input.step_index < 2 else replace(plan, slices=(), preempted_request_ids=())

    engine, runner, log = start_engine(FakeRunner(num_pages=64), plan=stuck, async_scheduling=False)
    r = request("r", 20, 10)
    engine.submit(r)
    time.sleep(0.5)
    assert calls <= 2 + 0.5 / engine.settings.idle_wait_s + 2, f"{calls} plans in 0.5 s: the engine spun"
    assert engine.abort("r")
    assert stream(r)[-1].finish_reason is FinishReason.ABORT  # freed before its last event goes out
    assert runner.kv_pool.num_free_pages == runner.kv_pool.num_pages
    assert runner.state_pool.num_free_slots == runner.state_pool.num_slots


class OutboxWatcher(FakeRunner):
    """A runner that looks at one request's event queue at each forward, before and after the engine's
    `while_waiting` (which a model process runs while it computes)."""

    def __init__(self, watched: Request) -> None:
        super().__init__(num_pages=256)
        self.watched = watched
        self.seen: list[tuple[int, int]] = []  # (events queued before while_waiting, after)

    def forward(self, batch: Batch, while_waiting: Callable[[], None] | None = None) -> ForwardOutput:
        before = self.watched.events.qsize()
        if while_waiting is not None:
            while_waiting()
        self.seen.append((before, self.watched.events.qsize()))
        return super().forward(batch)


def test_a_steps_events_go_out_while_the_next_forward_runs(start_engine):
    """Each decode step's token reaches the stream during the next step's forward (not before it, so
    that stream threads run beside the model), and the last events go out with no forward to wait for."""
    watched = request("w", 5, 6)
    runner = OutboxWatcher(watched)
    engine, _, log = start_engine(runner)
    engine.submit(watched)
    deadline = time.monotonic() + 20
    while watched.events.qsize() < 6 and time.monotonic() < deadline:  # 5 tokens + the last event
        time.sleep(0.01)
    events = stream(watched)
    assert tokens_of(events) == expected_tokens(6)
    assert events[-1].finish_reason is FinishReason.LENGTH
    # forward 1 prefills (nothing queued yet); forward k > 1 hands over the token of step k - 1
    assert runner.seen[0] == (0, 0)
    for k, (before, after) in enumerate(runner.seen[1:], start=1):
        assert (before, after) == (k - 1, k), runner.seen
    assert len(runner.seen) == 6  # the 6th token (and the last event) went out with no 7th forward


class ElsewhereRunner(FakeRunner):
    """A runner whose forward runs elsewhere (as the model process's does): the engine plans the next
    step in `while_waiting`, on its own thread."""

    def runs_elsewhere(self, batch: Batch) -> bool:
        return True


def test_with_the_forward_elsewhere_the_engine_thread_plans_during_it(start_engine):
    threads: list[str] = []

    def plan(step: StepInput) -> StepPlan:
        threads.append(threading.current_thread().name)
        return plan_step(step)

    engine, runner, log = start_engine(ElsewhereRunner(num_pages=256), plan=plan)
    requests = [request(f"r{i}", 5 + 4 * i, 6) for i in range(3)]
    for r in requests:
        engine.submit(r)
    for r in requests:
        assert tokens_of(stream(r)) == expected_tokens(6)
    assert threads[0] == "engine"  # the first plan: nothing ran yet, planned before any forward
    assert set(threads) == {"engine"}, threads  # every later one during a forward, never on the planner thread
    assert len(threads) >= len(log.steps)
    assert_drained(log, runner)
