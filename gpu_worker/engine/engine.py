"""The engine loop: plan a step with the scheduler service, execute it on the model runner, apply
the sampled tokens, stream them out, and tell the observers.

One step (`Engine._step`):

1. plan     the plan of this step (requested during the previous step when scheduling asynchronously)
2. prepare  preemptions, admissions, pages, checkpoint slots -> the batch's rows
3. execute  the runner (gpu_worker.runner.protocol.Runner) computes the rows' chunks and samples one token
            per row that reached the end of its request's known tokens, where the logits are
4. apply    each token to its request: stream it, or end the request (EOS, stop, length)
5. emit     one frozen StepRecord to the observers, then the ended requests' last events

One thread owns every request, page and slot; other threads only enqueue (`submit`, `abort`) and
read counters. That thread first runs the start-up `warm_up`, when given (the worker's:
gpu_worker.api.lifecycle.Warmup): it is the runner's only caller, so no warm-up step meets a real one, and
requests submitted meanwhile wait in the door.

With asynchronous scheduling the plan of step N+1 is requested while step N runs, from the state step N
will leave behind if every scheduled decode yields one token; requests that finish in step N are
reconciled one step late (their slices in plan N+1 are skipped).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import cached_property

from gpu_worker.cache.interface import NoPrefixCache, PrefixCache
from gpu_worker.engine import failures
from gpu_worker.engine.allocator import Allocator
from gpu_worker.engine.door import Door
from gpu_worker.engine.grammar import GrammarCompiler
from gpu_worker.engine.observer import EngineObserver, finished_record, queued_record, served_slices
from gpu_worker.engine.output import Ending, OutputProcessor
from gpu_worker.engine.planning import PlanFn, Planned, Planning, ShareAccountant
from gpu_worker.engine.prepare import PreparedStep, prepare_step, step_sampling
from gpu_worker.engine.records import EngineCounters, FirstToken, Occupancy, StepRecord
from gpu_worker.engine.request import FinishReason, Request
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.engine.speculation import observe_step, speculator_for, step_drafts
from gpu_worker.engine.table import RequestTable
from gpu_worker.runner.protocol import Runner, StepOutput
from hybridserve.errors import (
    AbortedError,
    DeadlineExceededError,
    HybridServeError,
    ResourceExhaustedError,
    UnavailableError,
)
from scheduler_svc.core import StepInput, StepPlan

log = logging.getLogger("hybridserve.engine")


class Engine:
    """`runner` is any Runner (gpu_worker.runner.protocol): the engine uses nothing else of it (the engine
    tests use fakes)."""

    def __init__(
        self,
        runner: Runner,
        plan: PlanFn,
        settings: EngineSettings,
        observer: EngineObserver | None = None,
        prefix: PrefixCache | None = None,
        warm_up: Callable[[], None] | None = None,
    ) -> None:
        self.runner = runner
        self._warm_up = warm_up  # run on the engine thread before its loop; it raises nothing
        self.settings = settings
        self.counters = EngineCounters()
        self.share = ShareAccountant(settings.scheduler)  # the prefill compute share's accounting
        self.observer = observer or EngineObserver()
        self.prefix = prefix or NoPrefixCache()
        self.table = RequestTable()
        self.allocator = Allocator(runner.pools.kv_pool, runner.pools.state_pool, self.prefix)
        self.outputs = OutputProcessor(runner.eos_token_ids)
        self._forwarded = False  # this iteration's step handed the outbox over during its forward
        self.planning = Planning(plan)
        self.door = Door(settings.max_queue_len)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.step_index = 0
        config = settings.scheduler  # the most pages one step can take: every token on a new page
        self._most_pages_per_step = -(-config.max_num_batched_tokens // config.kv_page_size) + config.max_num_seqs
        self.speculator = speculator_for(settings)  # drafts (gpu_worker.engine.speculation); None: off

    # ---- called from any thread ----------------------------------------------------------------
    @cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler: specs compiled at admission (on the RPC threads), one matcher per
        request. Made at the first constrained request (two made at once would be equal: one is kept)."""
        loaded = self.runner.loaded
        return GrammarCompiler(loaded.tokenizer, self.runner.config.vocab_size, self.runner.eos_token_ids)

    def start(self) -> None:
        self.observer.occupancy_changed(self._occupancy())
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self.door.wake()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # still in a step or waiting for a scheduler: end the requests now
            self.door.close(failures.shutting_down())
        self.planning.shutdown()
        self.prefix.close()

    def submit(self, request: Request) -> None:
        """Queues an admitted request; raises InvalidArgumentError on a duplicate id,
        ResourceExhaustedError when the queue is full, UnavailableError once the engine stopped."""

        def queued(r: Request) -> None:  # before the engine sees it
            r.trace_context = self.observer.request_queued(queued_record(r))

        self.door.submit(request, self.num_waiting, queued)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Ends a live request (freeing its pages and slot on the engine thread); False if unknown."""
        return self.door.abort(request_id, reason)

    def abort_request(self, request: Request, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Ends this very request if it is still live (not a later one that reused its id)."""
        return self.door.abort(request.request_id, reason, only=request)

    def is_alive(self) -> bool:
        """Liveness: the engine thread runs its loop (and the model process, when there is one, lives)."""
        return self._thread.is_alive() and self.door.closed_with is None and self.runner.is_alive()

    @property
    def num_live(self) -> int:
        """Requests submitted and not ended yet (queued, fetching, waiting or running)."""
        return self.door.num_live

    @property
    def num_running(self) -> int:
        return self.table.num_running

    @property
    def num_waiting(self) -> int:
        return self.table.num_waiting

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        """The loop; an exception in one iteration fails the requests it involved and the loop goes
        on. Should the loop itself end (stop, or a failure of that guard), every live and later
        request gets UNAVAILABLE at once."""
        error = failures.shutting_down()
        try:
            if self._warm_up is not None:
                self._warm_up()
            pending: Future[Planned] | None = None
            while not self._stopping.is_set():
                try:
                    pending = self._iterate(pending)
                except Exception as exc:
                    pending = None
                    self._fail_involved(exc)
        except BaseException as exc:  # logged there; the thread ends
            error = failures.engine_stopped(exc)
        finally:
            self.outputs.flush()  # what the last steps produced, before the live requests' errors
            self.door.close(error)  # every live request (and every later one) gets `error`

    def _iterate(self, pending: Future[Planned] | None) -> Future[Planned] | None:
        changed = self._drain_inbox()
        changed = self._enqueue_fetched() or changed
        changed = self._expire_deadlines() or changed
        if changed:
            self.observer.occupancy_changed(self._occupancy())
        if not self.table.has_plannable_work():
            self._idle()
            return None
        self._forwarded = False
        try:
            with self.observer.step(self.step_index):
                return self._step(pending)
        finally:
            if not self._forwarded:  # else the step's forward handed them over while it ran
                self.outputs.flush()

    def _step(self, pending: Future[Planned] | None) -> Future[Planned] | None:
        """One step; returns the plan request of the next step when scheduling asynchronously."""
        started = time.monotonic()
        planned = self._await_plan(pending)  # 1. plan
        if planned is None:
            return None
        plan = planned.plan
        stalled = not plan.slices  # nothing to run: the plan only reclaims (remedies, preemptions)
        if (stalled or plan.dropped_prefix_request_ids) and pending is not None:
            return None  # planned ahead from a predicted state: plan again from the real one
        waited_s = time.monotonic() - started
        step_index, self.step_index = self.step_index, self.step_index + 1
        if self.speculator is not None:
            self.speculator.step = self.step_index
        if stalled:  # apply what it reclaims, so that the next plan differs
            prepared, endings = self._unstall(plan)
            self._emit(step_index, planned, prepared, False, waited_s, started)
            self._end(endings)
            return None
        prepared = self._prepare(planned.plan)  # 2. prepare (allocate)
        following = self._plan_ahead(prepared)  # (async) step N+1's plan while step N runs
        forward_started = time.monotonic()
        output = self._execute(prepared)  # 3. execute
        if isinstance(output, HybridServeError):  # the step failed, and so do the running requests
            endings, yielded = self._fail_running(output), False
        else:
            if output is not None and prepared.yielding_rows and prepared.batch is not None:  # tokens: it is done
                self.prefix.record_forward(prepared.batch.num_prefill_tokens, time.monotonic() - forward_started)
            endings, yielded = self._apply(prepared, output), True  # 4. apply
        sampled = output if not isinstance(output, HybridServeError) else None
        self._emit(step_index, planned, prepared, yielded, waited_s, started, sampled)  # 5. emit the step record
        self._end(endings)  # the ended requests' last events, after the record
        return following

    # ---- 1. plan ---------------------------------------------------------------------------------
    def _await_plan(self, pending: Future[Planned] | None) -> Planned | None:
        """The plan requested during the last step, or a fresh one; None (every live request
        failed) when no scheduler answers or the scheduler rejects the state."""
        try:
            return pending.result() if pending is not None else self.planning.now(self._snapshot())
        except UnavailableError as exc:
            self._fail_all(exc)
        except HybridServeError as exc:  # the worker sent an inconsistent state: a bug
            log.exception("the scheduler rejected step %d", self.step_index)
            self._fail_all(UnavailableError(f"step planning failed: {exc}"))
        return None

    def _plan_ahead(self, prepared: PreparedStep) -> Future[Planned] | None:
        """Step N+1's plan, requested now from the state step N will leave. A runner whose forward runs
        elsewhere (`runs_elsewhere(batch)`: the model process) has this thread wait for it anyway, so
        the plan is made here during that wait (`_while_forwarding`); else on the planner thread."""
        if not (self.settings.async_scheduling and self.table.has_plannable_work()):
            return None
        inline = prepared.batch is not None and self.runner.runs_elsewhere(prepared.batch)
        return self.planning.ahead(self._snapshot(prepared), inline)

    def _while_forwarding(self) -> None:
        """What this thread does while the model process computes: hand the last step's events to the
        streams, then plan the next step."""
        self.outputs.flush()
        self.planning.make_inline()

    def _snapshot(self, in_flight: PreparedStep | None = None) -> StepInput:
        """The scheduler's view; with the step `in_flight`, as it will be once that step ran: each
        row that yields adds its token (computed counts were advanced when it was prepared)."""
        yielding_ids: set[str] | None = set()
        if in_flight is not None:  # its rows' requests are running: as many yielding as running means all
            yielding_ids = None if len(in_flight.yielding) == self.table.num_running else in_flight.yielding_ids
        running, waiting = self.table.sched_states(yielding_ids)
        free_pages = self.allocator.num_free_pages(self._most_pages_per_step)
        if self.speculator is not None:  # the drafts ready; pages held back for those in flight
            running = self.speculator.with_drafts(running, list(self.table.running.values()))
            if in_flight is not None:
                free_pages -= self.speculator.page_reserve(in_flight.rows)
        return StepInput(
            config=self.settings.scheduler,
            running=running,
            waiting=waiting,
            step_index=self.step_index,
            num_free_kv_pages=max(free_pages, 0),
            share=self.share.state,
            pinned_kv_pages=self.allocator.pinned_pages(self.table.waiting.values()) if waiting else (),
        )

    # ---- 2. prepare ------------------------------------------------------------------------------
    def _prepare(self, plan: StepPlan) -> PreparedStep:
        """The plan's rows, with its preemptions, admissions and pages (gpu_worker.engine.prepare)."""
        block_size = self.settings.scheduler.block_size
        return prepare_step(plan, self.table, self.allocator, block_size, self._enqueue, self.speculator)

    def _unstall(self, plan: StepPlan) -> tuple[PreparedStep, list[Ending]]:
        """Applies a plan without slices: its dropped prefix hits and preemptions (prepare), then the
        requests it fails because they can never fit (scheduler_svc/core/remedies.py). Returns the
        step as prepared (no rows) and the endings. The planner returns no empty plan while requests
        wait or run; should one come anyway, the loop waits a moment rather than spin on it."""
        prepared = self._prepare(plan)
        endings: list[Ending] = []
        for request_id in plan.failed_request_ids:
            request = self._remove(request_id)
            if request is None:
                continue
            log.warning("request %s can never fit in the KV pool; failing it, as planned", request_id)
            error = ResourceExhaustedError(
                f"request {request_id} cannot be scheduled: its tokens do not fit in the KV pages this worker"
                " has; lower max_tokens or shorten the prompt"
            )
            endings.append(self.outputs.failed(request, error))
        if not (plan.preempted_request_ids or plan.dropped_prefix_request_ids or plan.failed_request_ids):
            log.error("step %d: the scheduler planned nothing for %d live requests", self.step_index,
                      self.table.num_running + self.table.num_waiting)  # fmt: skip
            self.door.wait(self.settings.idle_wait_s)
        return prepared, endings

    # ---- 3. execute, 4. apply -------------------------------------------------------------------
    def _execute(self, prepared: PreparedStep) -> StepOutput | HybridServeError | None:
        """The runner's tokens for the yielding rows (None without rows), or the error that failed the step."""
        batch = prepared.batch
        if batch is None:
            return None
        self._forwarded = True
        try:
            words = self.grammars.words if self.table.num_running_constrained else 0  # the compiler, once needed
            sampling = step_sampling(prepared, self.table, words)
            output = self.runner.execute(batch, sampling, while_waiting=self._while_forwarding)
        except Exception as exc:
            self._while_forwarding()  # if the step failed before it could
            self.prefix.discard(prepared.checkpoints)
            log.exception("the step failed; failing the step's requests")
            return AbortedError(f"model forward failed: {type(exc).__name__}: {exc}; send the request again")
        self.prefix.register(prepared.checkpoints)  # before apply frees finished requests' pages
        return output

    def _apply(self, prepared: PreparedStep, sampled: StepOutput | None) -> list[Ending]:
        """Each sampled token to its request; returns the requests that ended (already freed)."""
        if sampled is None:
            return []
        for row, values in sampled.prompt_scores:  # before the tokens: a first token's event carries them
            request = prepared.rows[row].request
            del request.prompt_logprobs[prepared.rows[row].chunk.start_pos :]  # a recompute scores again
            request.prompt_logprobs.extend(values)
        if not prepared.yielding:
            return []
        now = time.monotonic()
        drafted: list[Ending] = []
        tokens = (prepared.yielding, sampled.token_ids, sampled.logprobs, sampled.top_logprobs)
        if sampled.drafts and self.speculator is not None:  # the accepted drafts first (speculation)
            drafted, tokens = self.speculator.apply(self.outputs, prepared, sampled, now)
        endings, firsts = self.outputs.append_step(*tokens, now)
        if sampled.proposals and self.speculator is not None:  # the MTP head's drafts for the next step
            self.speculator.proposed(prepared.rows, sampled.proposals)
        endings = drafted + endings if drafted else endings
        for request in firsts:
            self.observer.request_first_token(FirstToken(request.request_id, request.arrival_time, now))
        for ending in endings:
            self._remove(ending.request.request_id)
        return endings

    # ---- 6. emit ---------------------------------------------------------------------------------
    def _emit(
        self,
        step_index: int,
        planned: Planned,
        prepared: PreparedStep,
        yielded: bool,
        waited_s: float,
        started: float,
        sampled: StepOutput | None = None,
    ) -> None:
        now = time.monotonic()
        record = StepRecord(
            step_index=step_index,
            step_input=planned.step_input,
            plan=planned.plan,
            served=served_slices(prepared, yielded),
            preempted_request_ids=prepared.preempted_request_ids,
            plan_wait_s=waited_s,
            plan_latency_s=planned.latency_s,
            wall_s=now - started,
            end_time_s=now,
            occupancy=self._occupancy(),
            drafts=step_drafts(prepared, sampled),
        )
        self.counters.add_step(record)
        if self.speculator is not None:
            observe_step(self.speculator, record)
        self.share.step_finished(record.step_input, record.plan, record.num_prefill_tokens, record.num_decode_tokens,
                                 record.wall_s - waited_s, now)  # fmt: skip
        self.observer.step_finished(record)

    # ---- between steps ---------------------------------------------------------------------------
    def _drain_inbox(self) -> bool:
        """Takes in new requests and aborts; True if there were any."""
        new, aborts = self.door.take()
        for request in new:
            self.table.watch_deadline(request)
            fetch = (  # a failed fetch is a miss; a request that scores its prompt computes all of it
                None if request.scoring else failures.guarded("shared-tier fetch", self.prefix.start_fetch, request)
            )
            if fetch is None:
                self._enqueue(request)
            else:
                self.table.add_fetching(request, fetch)
                fetch.add_done_callback(lambda _: self.door.wake())
        removed = [(r, reason) for rid, reason in aborts if (r := self._remove(rid)) is not None]
        self._end([self.outputs.aborted(r, reason) for r, reason in removed])
        return bool(new or aborts)

    def _enqueue_fetched(self) -> bool:
        """Moves requests whose shared-tier fetch finished into the waiting queue."""
        fetched = self.table.pop_fetched()
        for request, fetch in fetched:
            lookup = failures.guarded(f"import for {request.request_id}", self.prefix.import_fetched, fetch)
            if lookup is not None:
                self.observer.cache_lookup(lookup)
            self._enqueue(request)
        return bool(fetched)

    def _expire_deadlines(self) -> bool:
        late = self.table.late(time.monotonic())
        for request in late:
            self._remove(request.request_id)
        self._end([self.outputs.failed(r, DeadlineExceededError(f"request {r.request_id} passed its deadline"))
                   for r in late])  # fmt: skip
        return bool(late)

    def _idle(self) -> None:
        self.outputs.flush()
        self.door.wait(self.settings.idle_wait_s)

    # ---- request lifecycle -----------------------------------------------------------------------
    def _enqueue(self, request: Request) -> None:
        """Into the waiting queue, holding the pages of its cached prefix if there is one."""
        lookup = None if request.scoring else self.allocator.attach_prefix(request)  # scoring: the whole prompt
        if lookup is not None:
            self.observer.cache_lookup(lookup)
        self.table.add_waiting(request)

    def _remove(self, request_id: str) -> Request | None:
        """Takes a live request out of every queue and frees what it holds."""
        request = self.table.pop_live(request_id)
        if request is not None:
            self.allocator.release(request)
            if self.speculator is not None:
                self.speculator.forget(request_id)
        return request

    def _fail_running(self, error: HybridServeError) -> list[Ending]:
        removed = [r for rid in list(self.table.running) if (r := self._remove(rid)) is not None]
        return [self.outputs.failed(r, error) for r in removed]

    def _fail_all(self, error: HybridServeError) -> None:
        live = self.table.live_requests()
        log.error("failing %d in-flight requests: %s", len(live), error)
        for request in live:
            self._remove(request.request_id)
        self._end([self.outputs.failed(r, error) for r in live])

    def _end(self, endings: list[Ending]) -> None:
        """Forgets the ids, tells the observers, delivers each last event."""
        self.door.forget([e.request.request_id for e in endings])
        now = time.monotonic()
        for e in endings:
            self.observer.request_finished(finished_record(e, now))
            self.outputs.deliver(e)

    def _fail_involved(self, exc: Exception) -> None:
        """An iteration raised: its step's requests (the running ones, and any taken out of a queue
        but not put back) fail with ABORTED; the rest stay queued."""
        involved = [*self.table.running.values(), *self.door.orphans(self.table.holds)]
        error = failures.step_failed(self.step_index, exc, [r.request_id for r in involved])
        for request in involved:
            failures.guarded("release", self._remove, request.request_id)  # frees what it holds, if it can
        self._end([self.outputs.failed(r, error) for r in involved])

    def _occupancy(self) -> Occupancy:
        return self.allocator.occupancy(self.table.num_running, self.table.num_waiting)
