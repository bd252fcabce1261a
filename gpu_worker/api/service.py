"""The Generation gRPC servicer: converts in, calls the engine, converts out."""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from gpu_worker.api.convert import generation_input_from_pb
from gpu_worker.engine.admission import build_request, max_model_len_limit
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.request import RequestOutput
from hybridserve import grpc_server
from hybridserve.errors import NotFoundError, ResourceExhaustedError, UnavailableError
from hybridserve.model_files import CHUNK_BYTES, ModelFiles
from hybridserve.v1 import generation_pb2 as pb

if TYPE_CHECKING:
    from gpu_worker.api.lifecycle import Warmup

POLL_S = 2.0  # how often a waiting stream checks that its client is still there (a cancel aborts at once)
CONTROL_THREADS = 16  # server threads beyond the streams: health, GetInfo, Abort and refusals never wait

# The engine's finish reason (gpu_worker.engine.FinishReason, a str enum, or its string value; "" while
# more follows) -> the wire enum.
FINISH_REASON_PB: dict[str, pb.FinishReason] = {
    "": pb.FINISH_REASON_UNSPECIFIED,
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "eos": pb.FINISH_REASON_EOS,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}


def finish_reason_to_pb(reason: object) -> pb.FinishReason:
    """The wire value of an engine finish reason, given as the enum member or its string value."""
    return FINISH_REASON_PB[str(getattr(reason, "value", reason) or "")]


def max_streams(engine: Engine) -> int:
    """Generate calls held at once: every request the engine can run plus every one it can queue."""
    return engine.settings.scheduler.max_num_seqs + engine.settings.max_queue_len


def server_threads(engine: Engine) -> int:
    """The gRPC server's threads: one per held stream (a sync stream holds its thread), plus spares
    so that health checks, GetInfo, Abort and the refusal of a stream beyond the limit never queue."""
    return max_streams(engine) + CONTROL_THREADS


class GenerationServicer:
    """Holds at most `max_streams(engine)` Generate calls; one more is refused with
    RESOURCE_EXHAUSTED at once, and every new one with UNAVAILABLE once `drain()` was called."""

    def __init__(
        self, engine: Engine, model_name: str, warmup: Warmup | None = None, model_files: ModelFiles | None = None
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        # the tokenizer, template and generation-config files GetModelFiles serves (None: none, hash "")
        self.model_files = model_files
        self.warmup = warmup  # what GetInfo says of the start-up warm-up; None: the engine runs none
        self.max_streams = max_streams(engine)
        self._lock = threading.Lock()
        self._num_streams = 0
        self.draining = False

    def drain(self) -> None:
        """Stops admitting: later Generate calls get UNAVAILABLE; those in flight go on."""
        self.draining = True

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        if self.draining:
            raise UnavailableError("this worker is shutting down; send the request to another worker")
        with self._lock:
            if self._num_streams >= self.max_streams:
                raise ResourceExhaustedError(
                    f"this worker holds {self.max_streams} streams (max_num_seqs + max_queue_len); retry later"
                )
            self._num_streams += 1
        try:
            yield from self._generate(request, context)
        finally:
            with self._lock:
                self._num_streams -= 1

    def _generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        """Streams one request. Every way the call can end before the request's last event (a cancel or
        disconnect, even one before the callback was added; a client found gone; an error; the stream
        closed) aborts the request, by the request itself: never a later one that reused its id."""
        asked = generation_input_from_pb(request)
        req = build_request(
            asked, self.engine.runner, self.engine.settings, context.time_remaining(), self.engine.grammars
        )
        self.engine.submit(req)

        def on_rpc_done() -> None:  # cancel / disconnect / the call ended
            self.engine.abort_request(req)

        finished = False
        try:
            if not context.add_callback(on_rpc_done):  # the call had already ended: no callback will run
                return
            events = req.events
            while True:
                try:
                    event = events.get(timeout=POLL_S)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                if event.error is not None:
                    finished = True  # the engine ended it
                    raise event.error
                behind = take_queued(events, event)
                if behind:  # the client fell behind: the events queued meanwhile go out as one message
                    event = merge_events(event, behind)
                if event.finish_reason is not None:
                    finished = True
                yield output_to_pb(req.request_id, event)
                if finished:
                    return
                if behind and behind[-1].error is not None:
                    finished = True
                    raise behind[-1].error
        finally:
            if not finished:
                self.engine.abort_request(req)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        if not self.engine.abort(request.request_id):
            raise NotFoundError(f"no live request with id {request.request_id!r}")
        return pb.AbortResponse()

    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.GetInfoResponse:
        engine, runner = self.engine, self.engine.runner
        counters, settings = engine.counters, engine.settings
        cache, memory, model_len = engine.prefix.stats(), runner.memory, max_model_len_limit(runner, settings)
        info = pb.GetInfoResponse(
            model=self.model_name,
            architecture=runner.config.architecture,
            model_fingerprint=runner.loaded.fingerprint,
            device=str(runner.device),
            dtype=str(runner.loaded.dtype).removeprefix("torch."),
            max_model_len=model_len.tokens,
            max_model_len_source=model_len.source,
            vocab_size=runner.config.vocab_size,
            kv_page_size=runner.pools.kv_page_size_tokens,
            block_size=settings.scheduler.block_size,
            num_kv_pages_total=runner.pools.kv_pool.num_pages,
            num_kv_pages_free=runner.pools.kv_pool.num_free_pages,
            num_state_slots_total=runner.pools.state_pool.num_slots,
            num_state_slots_free=runner.pools.state_pool.num_free_slots,
            kv_bytes_per_token=runner.pools.kv_bytes_per_token,
            state_bytes_per_request=runner.pools.state_bytes_per_request,
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            max_queue_len=settings.max_queue_len,
            num_steps=counters.num_steps,
            step_wall_seconds=counters.step_wall_seconds,
            scheduler_wait_seconds=counters.scheduler_wait_seconds,
            num_preemptions=counters.num_preemptions,
            num_stalled_steps=counters.num_stalled_steps,
            async_scheduling=settings.async_scheduling,
            num_generated_tokens=counters.num_generated_tokens,
            prefix_cache_queries=cache.prefix_cache_queries,
            prefix_cache_hits=cache.prefix_cache_hits,
            prefix_cache_declined_tokens=cache.num_declined_tokens,
            prefix_cache_miss_reasons=cache.miss_reasons or {},
            memory_budget_bytes=memory.budget_bytes,
            kv_pool_bytes=memory.kv_pool_bytes,
            state_pool_bytes=memory.state_pool_bytes,
            checkpoint_pool_bytes=memory.checkpoint_pool_bytes,
            num_checkpoint_slots=memory.num_checkpoint_slots,
            weights_bytes=memory.weights_bytes,
            activation_budget_bytes=memory.activation_bytes,
            **memory.activation_info(),
            memory_source=memory.source,
            device_memory_bytes=memory.device_total_bytes,
            decode_compile=str(runner.describe().get("decode_compile", "off")),
            num_speculative_tokens=settings.num_speculative_tokens,
            spec_decode_num_draft_tokens=counters.num_draft_tokens,
            spec_decode_num_accepted_tokens=counters.num_accepted_tokens,
        )
        if self.warmup is not None:
            warmup_to_pb(self.warmup, info)
        if self.model_files is not None:
            info.model_files_hash = self.model_files.hash
        return info

    def GetModelFiles(
        self, request: pb.GetModelFilesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ModelFileChunk]:
        """The allow-listed model files (hybridserve/model_files.py), in chunks of at most CHUNK_BYTES."""
        files = self.model_files
        if files is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker serves no model files")
            return
        if request.model_files_hash and request.model_files_hash != files.hash:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker serves model files {files.hash}, not {request.model_files_hash}",
            )
            return
        yield from model_file_chunks(files)


def model_file_chunks(files: ModelFiles) -> Iterator[pb.ModelFileChunk]:
    """Each file in name order, cut into chunks of at most CHUNK_BYTES (an empty file: one empty chunk)."""
    for name, data in files.files.items():
        digest = hashlib.sha256(data).hexdigest()
        view = memoryview(data)
        for offset in range(0, max(len(data), 1), CHUNK_BYTES):
            chunk = bytes(view[offset : offset + CHUNK_BYTES])
            yield pb.ModelFileChunk(name=name, offset=offset, data=chunk, total_size=len(data), sha256=digest)


def warmup_to_pb(warmup: Warmup, info: pb.GetInfoResponse) -> None:
    """Fills GetInfoResponse's warm-up fields."""
    times = warmup.times
    info.warmup_state = warmup.state
    info.warmup_seconds = warmup.seconds
    info.warmup_compile_seconds = times.compile_s
    info.warmup_kernels_seconds = times.kernels_s
    info.warmup_graphs_seconds = times.graphs_s
    info.warmup_steps_seconds = times.steps_s
    info.warmup_done_unix_seconds = warmup.done_unix_s


def take_queued(events: queue.SimpleQueue[RequestOutput], first: RequestOutput) -> list[RequestOutput]:
    """The events already queued after `first` (none when the stream keeps up: no wait, so no
    latency added), up to the request's last one; an error event, if one came, is the last taken."""
    taken: list[RequestOutput] = []
    if first.finish_reason is not None:
        return taken
    while not events.empty():  # only this stream takes from its queue: empty() is exact here
        event = events.get_nowait()  # (and, unlike a get_nowait that raises Empty, costs nothing when empty)
        taken.append(event)
        if event.finish_reason is not None or event.error is not None:
            break
    return taken


def merge_events(first: RequestOutput, later: list[RequestOutput]) -> RequestOutput:
    """Consecutive events of one request as one: tokens, log-probabilities and text in order; the
    finish reason and usage of the last. An error event among `later` is left out (raised after)."""
    events = [first, *(e for e in later if e.error is None)]
    last = events[-1]
    return RequestOutput(
        tuple([t for e in events for t in e.token_ids]),
        tuple([lp for e in events for lp in e.logprobs]),
        tuple([top for e in events for top in e.top_logprobs]),
        "".join([e.text for e in events]),
        last.finish_reason,
        last.prompt_tokens,
        last.cached_tokens,
        last.completion_tokens,
        None,
        tuple([lp for e in events for lp in e.prompt_logprobs]),
    )


def output_to_pb(request_id: str, event: RequestOutput) -> pb.GenerateResponse:
    if event.finish_reason is None:  # a token on its way: no finish reason (unspecified), no usage
        msg = pb.GenerateResponse(
            request_id=request_id, token_ids=event.token_ids, logprobs=event.logprobs, text=event.text
        )
    else:
        msg = pb.GenerateResponse(
            request_id=request_id,
            token_ids=event.token_ids,
            logprobs=event.logprobs,
            text=event.text,
            finish_reason=finish_reason_to_pb(event.finish_reason),
        )
    if event.prompt_logprobs:
        msg.prompt_logprobs.extend(event.prompt_logprobs)
    for top in event.top_logprobs:
        if top:
            msg.top_logprobs.add(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
    if event.finish_reason is not None:
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=event.prompt_tokens,
                cached_tokens=event.cached_tokens,
                completion_tokens=event.completion_tokens,
            )
        )
    return msg


def add_to_server(servicer: GenerationServicer) -> grpc_server.Adder:
    def add(server: grpc.Server) -> str:
        return grpc_server.add_servicer(server, pb.DESCRIPTOR.services_by_name["Generation"], servicer)

    return add
