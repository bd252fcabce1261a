"""Scheduler benchmarks; prints ratios measured side by side in one run.

1. In-process plan latency (median, p99) for 64 / 256 / 1024 / 4096 running requests, and the cost
   per request relative to the 64-request case (linear growth keeps it near 1.0x).
2. PlanStep round trip vs a bare Echo RPC carrying a payload of the same size, same server, same
   channel, interleaved: the p50 ratio is the planner's overhead over the gRPC floor.

    python bench/bench_scheduler.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import grpc

from hybridserve.stats import percentile
from hybridserve.v1 import scheduler_bench_pb2 as bench_pb
from hybridserve.v1 import scheduler_bench_pb2_grpc as bench_pb_grpc
from hybridserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc import convert
from scheduler_svc.core import MambaCacheMode, RequestState, SchedulerConfig, StepInput, plan_step
from scheduler_svc.server import create_server

TARGET_MEDIAN_US_AT_256 = 100.0
TARGET_RTT_RATIO = 1.3


def workload(num_running: int, step_index: int = 7) -> StepInput:
    """A busy step: 7/8 decodes, 1/8 long prefills, a few waiting, micro-slicing on."""
    config = SchedulerConfig(
        max_num_batched_tokens=16384,
        max_num_seqs=max(num_running, 8) + 8,
        long_prefill_token_threshold=0,
        max_num_prefill_tokens_per_step=4096,
        block_size=2048,
        mamba_block_size=256,
        mamba_cache_mode=MambaCacheMode.ALIGN,
        kv_page_size=16,
    )
    running = []
    for i in range(num_running):
        if i % 8 == 7:
            running.append(RequestState(f"req-{i:06d}", 32768, 2048 * (i % 5), 0, 512, 0, float(i)))
        else:
            running.append(RequestState(f"req-{i:06d}", 900 + i % 300, 900 + i % 300 + 40, 41, 512, 0, float(i)))
    waiting = [RequestState(f"wait-{i:04d}", 4000, 0, 0, 256, 0, float(num_running + i)) for i in range(8)]
    return StepInput(config, tuple(running), tuple(waiting), step_index, 10**7)


def bench_in_process(repeats: int) -> dict[int, float]:
    print("In-process plan_step latency (pure planner, validation included)")
    print(f"{'running':>8} {'median us':>10} {'p99 us':>10} {'us/request':>11} {'vs 64':>7}")
    medians: dict[int, float] = {}
    base_per_request = 0.0
    for n in (64, 256, 1024, 4096):
        step = workload(n)
        rounds = max(20, repeats * 64 // n)
        for _ in range(3):
            plan_step(step)  # warm-up
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            plan_step(step)
            samples.append((time.perf_counter() - t0) * 1e6)
        med = statistics.median(samples)
        medians[n] = med
        per_request = med / n
        base_per_request = base_per_request or per_request
        p99 = percentile(samples, 99)
        print(f"{n:>8} {med:>10.1f} {p99:>10.1f} {per_request:>11.3f} {per_request / base_per_request:>6.2f}x")
    verdict = "meets" if medians[256] <= TARGET_MEDIAN_US_AT_256 else "MISSES"
    print(f"median at 256 running: {medians[256]:.1f} us ({verdict} the <= {TARGET_MEDIAN_US_AT_256:.0f} us target)")
    return medians


def bench_round_trip(repeats: int, num_running: int = 256) -> float:
    server, port, _ = create_server("127.0.0.1", 0, max_workers=4, bench_service=True)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.SchedulerStub(channel)
            bench_stub = bench_pb_grpc.SchedulerBenchStub(channel)
            request = convert.step_to_pb(workload(num_running))
            size = request.ByteSize()
            echo = bench_pb.EchoRequest(payload=b"\x5a" * (size - 4))  # same bytes on the wire (+/- tag overhead)
            plan_samples: list[float] = []
            echo_samples: list[float] = []
            for i in range(repeats + 50):
                for kind in (0, 1) if i % 2 == 0 else (1, 0):  # interleave, alternating order
                    t0 = time.perf_counter()
                    if kind == 0:
                        stub.PlanStep(request, timeout=10)
                    else:
                        bench_stub.Echo(echo, timeout=10)
                    elapsed = (time.perf_counter() - t0) * 1e6
                    if i >= 50:  # warm-up discarded
                        (plan_samples if kind == 0 else echo_samples).append(elapsed)
    finally:
        server.stop(None)
    plan_p50, echo_p50 = statistics.median(plan_samples), statistics.median(echo_samples)
    ratio = plan_p50 / echo_p50
    print(f"\ngRPC round trip, {num_running} running requests, request {size} bytes, echo {echo.ByteSize()} bytes")
    print(f"{'rpc':>10} {'p50 us':>10} {'p99 us':>10}")
    print(f"{'PlanStep':>10} {plan_p50:>10.1f} {percentile(plan_samples, 99):>10.1f}")
    print(f"{'Echo':>10} {echo_p50:>10.1f} {percentile(echo_samples, 99):>10.1f}")
    verdict = "meets" if ratio <= TARGET_RTT_RATIO else "MISSES"
    print(f"PlanStep / Echo p50 ratio: {ratio:.2f} ({verdict} the <= {TARGET_RTT_RATIO} target)")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    bench_in_process(args.repeats)
    bench_round_trip(args.repeats)


if __name__ == "__main__":
    main()
