"""Faults under load: kill -9 of each component (scheduler, worker, cache service, Redis) while 64
greedy streams run on one worker, against real processes (tests/faults/stack.py: the same stack as
tests/faults/). Each stream's outcome is sorted into completed (the tokens of a cold reference run
of the same prompts), clear error (a status with a message: UNAVAILABLE, ABORTED, ...), hung (its
deadline passed, or no answer) and wrong output; for each restart, the seconds until the process
listens again and until a new request is served (for the cache service and Redis: and a BlockCache
Lookup is answered, so Redis is reached again). Last, 256 streams on the worker with readiness
checks on the side (4 probers, each every 20 ms, a fresh channel per check as a probe makes it): the
checks' latency (p50, p99, max) and how many failed or took over a second, and the streams' outcomes.
Then kill -9 of the worker's model process, which the worker replaces itself: the same outcomes, the
seconds until its liveness reads SERVING again and until a new request is served. Then a gateway in
front of the worker: its /health latency (p50, p99, max; target p99 under 100 ms)
while 16 MiB request bodies (a text prompt, token ids, nested lists) arrive from two senders.

Step memory (tests/robustness/step_memory.py): for each of --memory-prompts, a fresh worker (model
processes on, --max-model-len the prompt) serves one prompt of that many tokens after a 3,000-token one;
each model process's resident memory before it, at its peak (sampled every 50 ms) and after, against the
activation budget. Soak: --soak-requests mixed requests (4 clients) on one worker; the worker's and its
model processes' resident memory (private RssAnon and shared-pool RssShmem) sampled every 500 requests,
and the slope after the first 1,000, MiB per 1,000 requests.

    python bench/bench_faults.py [--streams 64] [--max-tokens 12] [--outage-s 1] [--health-streams 256]
                                 [--health-max-tokens 32] [--big-bodies 12] [--only-gateway-health]
                                 [--only-model-process] [--sections faults,memory,soak]
                                 [--memory-prompts 2000,8000,32000,60000] [--soak-requests 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridserve.children import free_port  # noqa: E402
from hybridserve.stats import percentile  # noqa: E402
from hybridserve.v1 import cache_pb2, cache_pb2_grpc  # noqa: E402
from tests.faults.stack import (  # noqa: E402
    COMPONENTS,
    GATEWAY_KEYS,
    Stack,
    health_check_s,
    health_status_name,
    http_health_s,
    prompts,
    run_streams,
    serves,
    start_gateway,
    tally,
    write_model,
)
from tests.gateway.conftest import SPEC as SOAK_SPEC  # noqa: E402
from tests.procs import ServerProcess  # noqa: E402
from tests.robustness.procs import worker  # noqa: E402
from tests.robustness.step_memory import (  # noqa: E402
    LONG_PROMPT_FLAGS,
    PeakSampler,
    memory_mb,
    mixed_request,
    model_process_pids,
    slope_mb_per_1000,
    token_request,
    write_long_prompt_model,
)

KINDS = ("completed", "clear error", "hung", "wrong output", "unclear error")
MODEL_PROCESS_LINE = re.compile(r"model process(?:es)? (\d+)[ ,]")  # "... ready" or "... replaced in"
SERVING = health_pb2.HealthCheckResponse.SERVING


def fault_round(stack: Stack, name: str, args: argparse.Namespace, reference: list[list[int]]) -> dict[str, object]:
    timings: dict[str, float] = {}

    def fault() -> None:
        stack.wait_progress(2 * args.streams)
        stack.kill(name)
        time.sleep(args.outage_s)
        start = time.monotonic()
        stack.start(name)
        timings["listening"] = time.monotonic() - start
        served = serves(stack.worker_address, prompts(1, seed=int(start))[0], 4, timeout_s=120) is not None
        if name in ("cache", "redis"):  # the shared tier itself answers again (Redis through the service)
            served = served and cache_answers(stack, timeout_s=120)
        timings["served"] = time.monotonic() - start if served else float("inf")

    outcomes = run_streams(
        stack.worker_address, PROMPTS[: args.streams], args.max_tokens, args.deadline_s, reference, during=fault
    )
    codes = Counter(o.code.name for o in outcomes if o.code is not None)
    return {"fault": f"kill -9 {name}", **tally(outcomes), **timings, "codes": dict(codes)}


def model_process_round(stack: Stack, args: argparse.Namespace, reference: list[list[int]]) -> dict[str, object]:
    """kill -9 of the worker's model process under the streams: the worker replaces it itself. Seconds
    until liveness reads SERVING again, and until a new request is served."""
    timings: dict[str, float] = {}

    def fault() -> None:
        stack.wait_progress(2 * args.streams)
        lines = stack.procs["worker"].lines
        pids = [int(m.group(1)) for line in lines if (m := MODEL_PROCESS_LINE.search(line))]
        os.kill(pids[-1], signal.SIGKILL)
        start = time.monotonic()
        deadline = start + 120
        while health_check_s(stack.worker_address, "liveness")[1] == SERVING and time.monotonic() < deadline:
            time.sleep(0.005)  # until the worker saw it
        while health_check_s(stack.worker_address, "liveness")[1] != SERVING and time.monotonic() < deadline:
            time.sleep(0.02)
        timings["listening"] = time.monotonic() - start
        served = serves(stack.worker_address, prompts(1, seed=int(start))[0], 4, timeout_s=120) is not None
        timings["served"] = time.monotonic() - start if served else float("inf")

    outcomes = run_streams(
        stack.worker_address, PROMPTS[: args.streams], args.max_tokens, args.deadline_s, reference, during=fault
    )
    codes = Counter(o.code.name for o in outcomes if o.code is not None)
    return {"fault": "kill -9 model process", **tally(outcomes), **timings, "codes": dict(codes)}


def cache_answers(stack: Stack, timeout_s: float) -> bool:
    """Polls a BlockCache Lookup until it is answered (OK), or timeout_s."""
    request = cache_pb2.LookupRequest(model_fingerprint="0" * 64, block_hashes=[b"0" * 32])
    deadline = time.monotonic() + timeout_s
    with stack.cache_channel() as channel:
        stub = cache_pb2_grpc.BlockCacheStub(channel)
        while time.monotonic() < deadline:
            try:
                stub.Lookup(request, timeout=2)
                return True
            except grpc.RpcError:
                time.sleep(0.02)
    return False


def health_under_load(stack: Stack, args: argparse.Namespace) -> tuple[list[float], int, Counter[str]]:
    """Readiness checks (each on a fresh channel, as a probe makes them) from PROBERS threads, each
    every 20 ms, while `--health-streams` streams run on the worker."""
    latencies: list[float] = []
    failures = 0
    done = threading.Event()
    lock = threading.Lock()

    def probe() -> None:
        nonlocal failures
        while not done.is_set():
            took, status = health_check_s(stack.worker_address, timeout_s=5.0)
            with lock:
                latencies.append(took)
                failures += health_status_name(status) != "SERVING"
            time.sleep(0.02)

    probers = [threading.Thread(target=probe, daemon=True) for _ in range(PROBERS)]
    many = prompts(args.health_streams, length=24, seed=5)

    def start_probing() -> None:
        for prober in probers:
            prober.start()

    outcomes = run_streams(stack.worker_address, many, args.health_max_tokens, args.deadline_s, during=start_probing)
    done.set()
    for prober in probers:
        prober.join(10)
    counts = tally(outcomes) + Counter(f"  {o.code.name}" for o in outcomes if o.code is not None)
    return latencies, failures, counts


PROBERS = 4
BIG_BODIES = (
    json.dumps({"model": "tiny", "prompt": "p" * (16 << 20)}).encode(),
    ('{"model": "tiny", "prompt": [' + "7," * (8 << 20) + "7]}").encode(),
    ('{"model": "tiny", "prompt": [' + "[]," * (5 << 20) + "[]]}").encode(),
)


def gateway_health_under_bodies(stack: Stack, args: argparse.Namespace) -> tuple[list[float], Counter[int]]:
    """GET /health every 20 ms on a gateway while two senders post `--big-bodies` 16 MiB bodies (the
    kinds of BIG_BODIES in turn); returns the latencies and the bodies' HTTP statuses."""
    http, _ = start_gateway(stack)
    statuses: Counter[int] = Counter()
    lock = threading.Lock()

    def send(indexes: range) -> None:
        for i in indexes:
            body, headers = BIG_BODIES[i % len(BIG_BODIES)], {"Authorization": f"Bearer {GATEWAY_KEYS[0]}"}
            request = urllib.request.Request(f"http://{http}/v1/completions", data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    status = response.status
            except urllib.error.HTTPError as err:
                status = err.code
            with lock:
                statuses[status] += 1

    senders = [threading.Thread(target=send, args=(range(k, args.big_bodies, 2),)) for k in range(2)]
    for sender in senders:
        sender.start()
    latencies: list[float] = []
    while any(s.is_alive() for s in senders):
        latencies.append(http_health_s(http))
        time.sleep(0.02)
    stack.launcher.terminate("gateway")
    return latencies, statuses


def print_gateway_health(latencies: list[float], statuses: Counter[int], args: argparse.Namespace) -> None:
    print(f"\ngateway /health (every 20 ms) during {args.big_bodies} bodies of 16 MiB from 2 senders: {len(latencies)}")
    if latencies:
        p50, p99 = (float(percentile(latencies, q) or 0.0) * 1e3 for q in (50, 99))
        print(
            f"  gateway /health p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {max(latencies) * 1e3:.1f} ms"
            f" (target p99 < 100 ms); failed or over 10 s: {sum(t == float('inf') for t in latencies)};"
            f" bodies answered: {dict(statuses)}"
        )


PROMPTS: list[list[int]] = []


def memory_rows(folder: Path, lengths: list[int]) -> list[str]:
    """One row per prompt length: each model process's VmRSS before, at its peak, after (MiB)."""
    model = write_long_prompt_model(folder)
    rows = []
    with ServerProcess(["scheduler", "--port", str(free_port())]) as scheduler:
        for length in lengths:
            client = worker(model, scheduler.address, *LONG_PROMPT_FLAGS, "--max-model-len", str(max(length, 3000) + 8))
            try:
                pids = model_process_pids(client)
                list(client.stub.Generate(token_request(3000, 2), timeout=600))
                before = {pid: memory_mb(pid)["VmRSS"] for pid in pids}
                started = time.monotonic()
                with PeakSampler(pids) as sampler:
                    list(client.stub.Generate(token_request(length, 2, seed=1), timeout=3600))
                took = time.monotonic() - started
                after = {pid: memory_mb(pid)["VmRSS"] for pid in pids}
                budget = client.info().activation_budget_bytes / (1 << 20)
                cells = "  ".join(f"{before[p]:.0f}/{sampler.peak_mb[p]:.0f}/{after[p]:.0f}" for p in pids)
                rows.append(f"{length:>8}{took:>9.1f}{budget:>12.1f}  {cells}")
            finally:
                client.close()
    return rows


def soak(folder: Path, count: int, clients: int = 4) -> tuple[list[str], dict[str, float], Counter[str]]:
    """`count` mixed requests from `clients` threads on one worker; (sample rows, slopes, outcomes)."""
    from hybridserve_cli.init_model import write_random_checkpoint

    model = write_random_checkpoint(folder / "soak", SOAK_SPEC, seed=3)
    rows: list[str] = []
    samples: dict[str, list[tuple[int, float]]] = {}
    outcomes: Counter[str] = Counter()
    with ServerProcess(["scheduler", "--port", str(free_port())]) as scheduler:
        client = worker(model, scheduler.address, "--memory-budget-mb", "64", "--max-num-seqs", "8")
        try:
            pids = {"worker": client.process.pid}
            pids |= {f"model {i}": pid for i, pid in enumerate(model_process_pids(client))}
            lock, done = threading.Lock(), [0]

            def run(first: int) -> None:
                for i in range(first, count, clients):
                    try:
                        list(client.stub.Generate(mixed_request(i), timeout=120))
                        kind = "ok"
                    except grpc.RpcError as exc:
                        kind = exc.code().name
                    with lock:
                        outcomes[kind] += 1
                        done[0] += 1

            threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
            for t in threads:
                t.start()
            next_sample = 0
            while any(t.is_alive() for t in threads) or next_sample <= done[0]:
                if done[0] >= next_sample:
                    mem = {name: memory_mb(pid) for name, pid in pids.items()}
                    for name, m in mem.items():
                        samples.setdefault(name, []).append((done[0], m["RssAnon"]))
                    rows.append(f"{done[0]:>8}  " + "  ".join(
                        f"{name} {m['VmRSS']:.1f} ({m['RssAnon']:.1f} + {m['RssShmem']:.1f})" for name, m in mem.items()
                    ))  # fmt: skip
                    print(rows[-1], flush=True)  # as it goes: a long soak cut short still shows its samples
                    next_sample += 500
                    if next_sample > count:
                        break
                time.sleep(0.05)
            for t in threads:
                t.join()
        finally:
            client.close()
    slopes = {name: slope_mb_per_1000([s for s in points if s[0] >= 1000]) for name, points in samples.items()}
    return rows, slopes, outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--outage-s", type=float, default=1.0)
    parser.add_argument("--deadline-s", type=float, default=60.0)
    parser.add_argument("--health-streams", type=int, default=256)
    parser.add_argument("--health-max-tokens", type=int, default=32)
    parser.add_argument("--big-bodies", type=int, default=12)
    parser.add_argument("--only-gateway-health", action="store_true", help="only the gateway /health row")
    parser.add_argument("--only-model-process", action="store_true", help="only the model-process kill row")
    parser.add_argument("--sections", default="faults,memory,soak", help="which parts to run, comma separated")
    parser.add_argument("--memory-prompts", default="2000,8000,32000,60000", help="prompt lengths, tokens")
    parser.add_argument("--soak-requests", type=int, default=10_000)
    args = parser.parse_args()
    if args.only_model_process:
        PROMPTS.extend(prompts(args.streams))
        with tempfile.TemporaryDirectory(prefix="bench-faults-") as folder:
            stack = Stack(write_model(Path(folder)))
            try:
                cold = run_streams(stack.worker_address, PROMPTS, args.max_tokens, args.deadline_s)
                row = model_process_round(stack, args, [o.tokens for o in cold])
            finally:
                stack.stop()
        print(f"{row['fault']}: " + ", ".join(f"{k} {row.get(k, 0)}" for k in KINDS)
              + f"; liveness SERVING again after {row['listening']:.2f} s, served after {row['served']:.2f} s;"
              f" statuses {row['codes'] or '-'}")  # fmt: skip
        return 0
    if args.only_gateway_health:
        with tempfile.TemporaryDirectory(prefix="bench-faults-") as folder:
            stack = Stack(write_model(Path(folder)))
            try:
                print_gateway_health(*gateway_health_under_bodies(stack, args), args)
            finally:
                stack.stop()
        return 0
    sections = set(args.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as folder:
        if "memory" in sections:
            lengths = [int(n) for n in args.memory_prompts.split(",")]
            lines = memory_rows(Path(folder), lengths)
            print("\nstep memory: one prompt on a fresh worker (after a 3,000-token one); per model process VmRSS MiB")
            print(f"{'tokens':>8}{'seconds':>9}{'budget MiB':>12}  before/peak/after")
            print("\n".join(lines))
        if "soak" in sections:
            print(f"\nsoak: {args.soak_requests} mixed requests, 4 clients; VmRSS MiB (RssAnon + RssShmem)", flush=True)
            _, slopes, outcomes = soak(Path(folder), args.soak_requests)
            print("private memory slope after 1,000 requests, MiB per 1,000: "
                  + ", ".join(f"{name} {slope:+.2f}" for name, slope in slopes.items()))  # fmt: skip
            print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    if "faults" not in sections:
        return 0
    PROMPTS.extend(prompts(args.streams))
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as folder:
        stack = Stack(write_model(Path(folder)))
        try:
            cold = run_streams(stack.worker_address, PROMPTS, args.max_tokens, args.deadline_s)
            assert tally(cold) == {"completed": args.streams}, tally(cold)
            reference = [o.tokens for o in cold]
            rows = [fault_round(stack, name, args, reference) for name in COMPONENTS]
            rows.append(model_process_round(stack, args, reference))
            latencies, failures, counts = health_under_load(stack, args)
            gateway_row = gateway_health_under_bodies(stack, args)
        finally:
            stack.stop()
    print(f"\n{args.streams} streams, {args.max_tokens} tokens each, outage {args.outage_s:.1f} s before the restart")
    header = f"{'fault':<22}" + "".join(f"{k:>14}" for k in KINDS) + f"{'listening s':>13}{'served s':>10}  statuses"
    print(header)
    print("-" * len(header))
    for row in rows:
        cells = "".join(f"{row.get(k, 0):>14}" for k in KINDS)
        print(f"{row['fault']:<22}{cells}{row['listening']:>13.2f}{row['served']:>10.2f}  {row['codes'] or '-'}")
    print(
        f"\nreadiness checks ({PROBERS} probers, each every 20 ms) during {args.health_streams} streams of"
        f" {args.health_max_tokens} tokens on one worker: {len(latencies)} checks"
    )
    if latencies:
        print(
            f"  latency p50 {percentile(latencies, 50) * 1e3:.1f} ms, p99 {percentile(latencies, 99) * 1e3:.1f} ms,"
            f" max {max(latencies) * 1e3:.1f} ms; over 1 s: {sum(t > 1.0 for t in latencies)};"
            f" not SERVING or failed: {failures}; mean {statistics.mean(latencies) * 1e3:.1f} ms"
        )
    print("  streams: " + ", ".join(f"{k.strip()} {v}" for k, v in sorted(counts.items())))
    print_gateway_health(*gateway_row, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
