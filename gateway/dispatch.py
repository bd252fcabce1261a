"""Sends one generation to a worker: choose (routing.py), call, relay; retry elsewhere on failure
before the first message.

A worker that fails before it streamed anything (UNAVAILABLE: dead or unreachable; RESOURCE_EXHAUSTED:
its queue is full; INTERNAL, UNKNOWN, ABORTED) is tried no more for this request, and the next best
worker gets it: the client never sees the failure. A request refused as invalid is not retried. After
the first message, a failure ends the request with `UpstreamError(after_first_message=True)`: the
tokens already relayed cannot be taken back. Cancelling the consumer cancels the worker call, which
aborts the request on the worker at once.

A message with a finish reason is the worker's last (it returns right after it): the stream ends
there, without waiting for the worker's trailing status, which is read in the background. Waiting
put a hop (often several milliseconds under load) between every request's last token and the
client's end of stream, and so before its next request in a closed loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

import grpc

from gateway.affinity import PrefixTable
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool, WorkerState
from gateway.routing import Candidate, RoutingPolicy, choose_worker, prefix_block_hashes, round_robin
from hybridserve.v1 import generation_pb2 as pb

log = logging.getLogger("hybridserve.gateway.dispatch")

RETRY_ON = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
    }
)


class NoWorkerError(Exception):
    """No worker is ready (or every one was tried)."""


class UpstreamError(Exception):
    """A worker ended the call with a status; `after_first_message` says whether output was relayed."""

    def __init__(self, code: grpc.StatusCode, details: str, address: str, after_first_message: bool) -> None:
        super().__init__(f"worker {address}: {code.name}: {details}")
        self.code = code
        self.details = details
        self.address = address
        self.after_first_message = after_first_message


@dataclass(frozen=True, slots=True)
class Route:
    """Where a live request runs, and who may abort it. One object per call: a call removes its own
    route only, never one a later call with the same id put in its place."""

    address: str  # the worker serving it now
    owner: str | None  # the API key that created it (None: keys are off, anyone may abort it)


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    mode: str = "prefix"  # "prefix" (affinity weighed against load) or "round-robin"
    request_cost_tokens: int = 64  # one active request, priced in prefill tokens (routing.RoutingPolicy)


class Dispatcher:
    def __init__(
        self, pool: WorkerPool, table: PrefixTable, settings: RoutingSettings, metrics: GatewayMetrics
    ) -> None:
        self.pool = pool
        self.table = table
        self.settings = settings
        self.metrics = metrics
        self.live: dict[str, Route] = {}  # request id -> its route, from admission to its last message
        self._counter = itertools.count()
        self._settling: set[asyncio.Task[None]] = set()  # worker calls past their last message

    def block_size(self) -> int:
        """The workers' cache grid, from the first ready worker's GetInfo (0 when unknown)."""
        for worker in self.pool.ready():
            if worker.info is not None and worker.info.block_size > 0:
                return int(worker.info.block_size)
        return 0

    def max_model_len(self) -> int:
        """The smallest max_model_len of the ready workers (tokens; 0 when none has said)."""
        infos = [w.info for w in self.pool.ready() if w.info is not None]
        return min((int(i.max_model_len) for i in infos if i.max_model_len > 0), default=0)

    def prefix_hashes(self, prompt: Sequence[int] | str, salt: str = "") -> tuple[int, ...]:
        return prefix_block_hashes(prompt, self.block_size(), salt=salt)

    def choose(self, prefix_hashes: tuple[int, ...], excluded: set[str]) -> WorkerState:
        workers = [w for w in self.pool.ready() if w.address not in excluded]
        if not workers:
            raise NoWorkerError("no worker is ready" if not excluded else "every ready worker failed this request")
        if self.settings.mode == "round-robin":
            address = round_robin([w.address for w in workers], next(self._counter))
        else:
            candidates = [
                Candidate(
                    w.address,
                    self.table.num_matched_blocks(prefix_hashes, w.address),
                    w.num_active_requests,
                    w.num_queued_prefill_tokens,
                )
                for w in workers
            ]
            policy = RoutingPolicy(max(self.block_size(), 1), self.settings.request_cost_tokens)
            key = prefix_hashes[0] if prefix_hashes else next(self._counter)
            address = choose_worker(candidates, key, len(prefix_hashes), policy)
        return self.pool.workers[address]

    async def generate(
        self,
        request: pb.GenerateRequest,
        prefix_hashes: tuple[int, ...],
        num_prompt_tokens: int,
        metadata: Sequence[tuple[str, str]] = (),
        timeout_s: float | None = None,
        owner: str | None = None,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The worker's messages for `request` (its request_id set here when empty). An id that is live
        here already is refused (INVALID_ARGUMENT) and leaves the live one's route as it was. The route
        goes before the last message is relayed, so the id is free again once a client has seen it."""
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        request_id = request.request_id
        if request_id in self.live:
            raise UpstreamError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id {request_id!r} is already in use by a live request; pick another",
                "gateway",
                False,
            )
        route: Route | None = None
        tried: set[str] = set()
        last_error: UpstreamError | None = None
        try:
            while True:
                try:
                    worker = self.choose(prefix_hashes, tried)
                except NoWorkerError:
                    if last_error is not None:
                        raise last_error from None
                    raise
                tried.add(worker.address)
                route = self.live[request_id] = Route(worker.address, owner)
                call = self._call(worker, request, prefix_hashes, num_prompt_tokens, metadata, timeout_s,
                                  functools.partial(self._unroute, request_id, route))  # fmt: skip
                try:
                    async with contextlib.aclosing(call) as messages:
                        async for message in messages:
                            yield message
                    return
                except UpstreamError as error:
                    if error.after_first_message or error.code not in RETRY_ON:
                        raise
                    log.info("retrying request %s elsewhere: %s", request_id, error)
                    self.metrics.retried(error.code.name)
                    last_error = error
        finally:
            if route is not None:
                self._unroute(request_id, route)

    def _unroute(self, request_id: str, route: Route | None) -> None:
        if route is not None and self.live.get(request_id) is route:
            del self.live[request_id]

    async def _call(
        self,
        worker: WorkerState,
        request: pb.GenerateRequest,
        prefix_hashes: tuple[int, ...],
        num_prompt_tokens: int,
        metadata: Sequence[tuple[str, str]],
        timeout_s: float | None,
        on_last: Callable[[], None],
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """One worker's messages for the request; its failure as UpstreamError. `on_last` runs just
        before the message with a finish reason is relayed."""
        matched = self.table.num_matched_blocks(prefix_hashes, worker.address)
        self.metrics.routed(worker.address, matched > 0)
        self.table.record(prefix_hashes, worker.address)
        relayed = finished = False
        queued = max(0, num_prompt_tokens - matched * self.block_size())  # prefill ahead, until the 1st message
        worker.num_in_flight += 1
        worker.num_queued_prefill_tokens += queued
        call = worker.stub.Generate(request, metadata=[*self.pool.metadata, *metadata], timeout=timeout_s)
        try:
            async for message in call:
                if not relayed:
                    relayed = True
                    worker.num_queued_prefill_tokens -= queued
                finished = message.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                if finished:
                    on_last()
                yield message
                if finished:
                    return
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_down(worker.address, f"Generate failed: {exc.details()}")
            raise UpstreamError(exc.code(), exc.details() or "", worker.address, relayed) from None
        finally:
            if finished:
                self._settle(call, worker.address)
            else:
                call.cancel()  # no-op when ended; aborts the worker's request when the consumer left
            worker.num_in_flight -= 1
            if not relayed:
                worker.num_queued_prefill_tokens -= queued

    def _settle(self, call: grpc.aio.UnaryStreamCall, address: str) -> None:  # type: ignore[type-arg]
        """Reads the status of a call past its last message off the request's path; the task holds
        the call (a call collected before its status is cancelled, which would abort on the worker)."""
        task = asyncio.get_running_loop().create_task(_await_status(call, address))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)


async def _await_status(call: grpc.aio.UnaryStreamCall, address: str) -> None:  # type: ignore[type-arg]
    """The trailing status of a finished worker call; anything but OK is only logged (the client has
    its whole output)."""
    code = await call.code()
    if code != grpc.StatusCode.OK:
        log.warning("worker %s ended a finished request with %s: %s", address, code.name, await call.details())
