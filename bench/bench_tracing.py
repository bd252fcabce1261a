"""Cost of observability: aggregate output tokens/s of one worker (the default tiny model, CPU or
GPU) under a fixed closed-loop load, side by side in one run, for three configurations:

- off:       no observer, no interceptors (what a process with OTEL_SDK_DISABLED runs)
- tracing:   every span (request, step with links, PlanStep client + server) exported over
             OTLP/gRPC with batching to a local receiver (tests/observability/otlp_receiver.py)
             running in its own process, as a collector would
- recording: step recording on (every step to a JSONL file), tracing off

The worker runs in this process; the scheduler and the receiver each run in their own process, as
deployed (a traced scheduler for the tracing rounds, an untraced one for the others). Rounds are
interleaved (off, tracing, recording, off, ...) and the median per configuration is compared:
target <= 3% loss with tracing on. Last, the tracing observer's own CPU cost per step, measured on
synthetic step records (no model, no network: it does not move with the load).

Besides tokens/s, each round reports CPU time per output token: of the engine thread (the step's
critical path: planning wait aside, everything a step does, observers included) and of the whole
worker process (exporter and gRPC threads too). On a shared, oversubscribed machine the wall
figures swing by tens of percent between rounds; CPU time per token barely moves, so it shows what
the observers cost even when tokens/s cannot.

    python bench/bench_tracing.py [--rounds 5] [--clients 8] [--requests 48] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_worker.api.service import GenerationServicer, add_to_server  # noqa: E402
from gpu_worker.engine.engine import Engine  # noqa: E402
from gpu_worker.engine.records import Occupancy, RequestQueued, ServedSlice, StepRecord  # noqa: E402
from gpu_worker.engine.settings import EngineSettings  # noqa: E402
from gpu_worker.observers import build_observers  # noqa: E402
from gpu_worker.observers.recording import StepRecorder  # noqa: E402
from gpu_worker.observers.tracing import TracingObserver  # noqa: E402
from gpu_worker.runner.runner import ModelRunner  # noqa: E402
from gpu_worker.runner.settings import RunnerConfig  # noqa: E402
from hybridserve import grpc_server  # noqa: E402
from hybridserve.v1 import generation_pb2 as pb  # noqa: E402
from hybridserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402
from hybridserve_cli.init_model import write_random_checkpoint  # noqa: E402
from scheduler_svc.client import SchedulerClient  # noqa: E402
from scheduler_svc.core import (  # noqa: E402
    MambaCacheMode,
    PlanStats,
    RequestState,
    SchedulerConfig,
    Slice,
    StepInput,
    StepPlan,
)
from tests.observability.otlp_receiver import Receiver  # noqa: E402
from tests.procs import ServerProcess  # noqa: E402

TARGET_TRACING_LOSS = 0.03


@dataclass(frozen=True, slots=True)
class Measured:
    tokens_per_s: float  # aggregate output tokens per wall second
    engine_cpu_us_per_token: float  # the engine thread's CPU time per output token, microseconds
    process_cpu_us_per_token: float  # this process's CPU time per output token (load generator included)


CONFIG = SchedulerConfig(
    max_num_batched_tokens=2048, max_num_seqs=16, long_prefill_token_threshold=0,
    max_num_prefill_tokens_per_step=512, block_size=256, mamba_block_size=64,
    mamba_cache_mode=MambaCacheMode.ALIGN, kv_page_size=16,
)  # fmt: skip


def start_scheduler(receiver_port: int | None) -> ServerProcess:
    """A scheduler process, exporting its spans to the receiver when receiver_port is given."""
    env = {"OTEL_SDK_DISABLED": "true"}
    if receiver_port is not None:
        env = {
            "OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver_port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_SERVICE_NAME": "hybridserve-scheduler", "OTEL_BSP_SCHEDULE_DELAY": "200",
        }  # fmt: skip
    return ServerProcess(["scheduler", "--host", "127.0.0.1", "--port", "0"], env=env)


def run_config(
    model: Path, kind: str, receiver_port: int, address: str, tmp: Path, args: argparse.Namespace
) -> Measured:
    """Starts a worker for one configuration, runs the load, returns what it measured."""
    provider = None
    if kind == "tracing":
        exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{receiver_port}", insecure=True)
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    runner_config = RunnerConfig(
        memory_budget_bytes=128 << 20, kv_page_size_tokens=16, max_num_seqs=16, num_checkpoint_slots=4,
        device=args.device, dtype="auto",
    )  # fmt: skip
    settings = EngineSettings(scheduler=CONFIG, runner=runner_config, scheduler_addresses=(address,))
    client = SchedulerClient([address], tracer_provider=provider)
    observer = None
    if kind == "tracing":
        observer = build_observers(tracer_provider=provider, model_name="tiny")
    elif kind == "recording":
        observer = build_observers(recorder=StepRecorder(tmp / f"steps-{time.monotonic_ns()}.jsonl"))
    engine = Engine(ModelRunner.from_model_dir(model, runner_config), client.plan, settings, observer)
    engine.start()
    server, port, _ = grpc_server.create_server(
        [add_to_server(GenerationServicer(engine, "tiny"))], tracer_provider=provider
    )
    server.start()
    try:
        assert engine._thread.ident is not None  # the engine thread's CPU clock
        return closed_loop(f"127.0.0.1:{port}", time.pthread_getcpuclockid(engine._thread.ident), args)
    finally:
        server.stop(None)
        engine.stop()
        client.close()
        if observer is not None:
            observer.close()
        if provider is not None:
            provider.shutdown()


def closed_loop(address: str, engine_clock: int, args: argparse.Namespace) -> Measured:
    channels = [grpc.insecure_channel(address) for _ in range(args.clients)]
    stubs = [pb_grpc.GenerationStub(c) for c in channels]
    prompt = [(7 * i) % 250 + 3 for i in range(args.prompt_tokens)]
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
    )
    per_client = args.requests // args.clients

    def client(i: int) -> int:
        return sum(len(m.token_ids) for _ in range(per_client) for m in stubs[i].Generate(request, timeout=120))

    list(stubs[0].Generate(request, timeout=120))  # warm-up
    started, engine_cpu, process_cpu = time.perf_counter(), time.clock_gettime(engine_clock), time.process_time()
    with ThreadPoolExecutor(args.clients) as pool:
        tokens = sum(pool.map(client, range(args.clients)))
    elapsed = time.perf_counter() - started
    engine_cpu, process_cpu = time.clock_gettime(engine_clock) - engine_cpu, time.process_time() - process_cpu
    for channel in channels:
        channel.close()
    return Measured(tokens / elapsed, engine_cpu / tokens * 1e6, process_cpu / tokens * 1e6)


def observer_cost(num_steps: int = 2000, num_requests: int = 8) -> tuple[float, float]:
    """CPU microseconds per step of the tracing observer alone, on a synthetic step record of
    `num_requests` decodes, spans exported through a BatchSpanProcessor into OTLP protobuf (encoded,
    not sent): (engine thread, whole process). Independent of the model and of the load."""

    class EncodeOnly(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(EncodeOnly(), max_queue_size=4 * num_steps))
    observer = TracingObserver(provider, "tiny")
    ids = [f"request-{i:04d}" for i in range(num_requests)]
    for rid in ids:
        observer.request_queued(RequestQueued(rid, 96, 32, 0, 0.0, 1.0, 0, None, (), 0.0))
    plan = StepPlan(
        tuple(Slice(r, 1, False, False) for r in ids), (), 256, PlanStats(num_requests, 0, 0, 0, False, False, 0)
    )
    step_input = StepInput(CONFIG, tuple(RequestState(r, 96, 100, 4, 32, 0, 0.0) for r in ids), (), 0, 1000)
    occupancy = Occupancy(num_requests, 0, 100, 1000, num_requests, 16)
    served = tuple(ServedSlice(r, 1, False, False, True, 5) for r in ids)
    process_started, thread_started = time.process_time(), time.thread_time()
    for i in range(num_steps):
        with observer.step(i):
            observer.step_finished(StepRecord(i, step_input, plan, served, (), 0.001, 0.002, 0.01, 0.0, occupancy))
    thread_s = time.thread_time() - thread_started
    observer.close()
    provider.shutdown()
    return thread_s / num_steps * 1e6, (time.process_time() - process_started) / num_steps * 1e6


def _receiver_process(conn) -> None:  # type: ignore[no-untyped-def]
    """Runs the OTLP receiver in a child process: sends its port, waits, sends the span count."""
    receiver = Receiver()
    conn.send(receiver.port)
    conn.recv()
    conn.send(len(receiver.spans))
    receiver.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    parent_end, child_end = multiprocessing.get_context("spawn").Pipe()
    receiver = multiprocessing.get_context("spawn").Process(target=_receiver_process, args=(child_end,), daemon=True)
    receiver.start()
    receiver_port = parent_end.recv()
    kinds = ("off", "tracing", "recording")
    results: dict[str, list[Measured]] = {k: [] for k in kinds}
    schedulers = {"plain": start_scheduler(None), "traced": start_scheduler(receiver_port)}
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            model = write_random_checkpoint(tmp / "model")
            for r in range(args.rounds):
                for kind in kinds:
                    address = schedulers["traced" if kind == "tracing" else "plain"].address
                    results[kind].append(run_config(model, kind, receiver_port, address, tmp, args))
                    m = results[kind][-1]
                    print(
                        f"round {r} {kind:<9} {m.tokens_per_s:8.1f} output tokens/s   CPU per token: engine thread"
                        f" {m.engine_cpu_us_per_token:6.0f} us, process {m.process_cpu_us_per_token:6.0f} us",
                        flush=True,
                    )
    finally:
        for scheduler in schedulers.values():
            scheduler.stop()
    parent_end.send("stop")
    num_spans = parent_end.recv()
    receiver.join(10)
    print(
        f"\nclients {args.clients}, requests {args.requests}, prompt {args.prompt_tokens}, max_tokens {args.max_tokens}"
    )
    print(f"spans received by the OTLP receiver: {num_spans}")
    rate = {k: statistics.median(m.tokens_per_s for m in v) for k, v in results.items()}
    engine_cpu = {k: statistics.median(m.engine_cpu_us_per_token for m in v) for k, v in results.items()}
    process_cpu = {k: statistics.median(m.process_cpu_us_per_token for m in v) for k, v in results.items()}
    for kind in kinds:
        print(
            f"{kind:<9} median {rate[kind]:8.1f} tokens/s (loss vs off {1.0 - rate[kind] / rate['off']:+.1%})"
            f"   CPU per token: engine thread {engine_cpu[kind] / engine_cpu['off'] - 1.0:+.1%},"
            f" process {process_cpu[kind] / process_cpu['off'] - 1.0:+.1%} vs off"
        )
    thread_us, process_us = observer_cost()
    print(
        f"tracing observer alone, 8 decodes a step: {thread_us:.0f} us CPU per step on the engine thread,"
        f" {process_us:.0f} us in the process (span export encoding included)"
    )
    tracing_loss = 1.0 - rate["tracing"] / rate["off"]
    verdict = "PASS" if tracing_loss <= TARGET_TRACING_LOSS else "FAIL"
    print(f"tracing loss {tracing_loss:+.1%} (target <= {TARGET_TRACING_LOSS:.0%}): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
