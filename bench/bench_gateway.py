"""Gateway benchmark, two parts, each measured side by side in one run.

1. Overhead: one worker under N closed-loop streaming clients, called directly over gRPC, through
   the gateway's gRPC proxy, and through the gateway's OpenAI HTTP API (server-sent events), all on
   the bench driver (hybridserve_cli.bench.driver). Target: <= 5% aggregate throughput loss and TTFT
   p50 + <= 2 ms through the gateway.
2. Routing: a shared-prefix workload (S system prompts of L tokens, Q short questions, interleaved at
   random) through the gateway's HTTP API, served by one worker, by two with round robin, and by two
   with prefix-aware routing; every configuration starts from cold workers. Each worker's prefix cache
   holds --checkpoint-slots block checkpoints (of --block-size tokens), fewer than all system prompts
   need, so where a prefix is served decides whether it is a hit. Reported: the prefix-cache hit rate
   (cached / prompt tokens), TTFT p50 / p95, and the split of requests over workers. Two workers share
   the same CPU cores here: no throughput scaling is claimed.

Model: the default random Bamba that `hybridserve init-model` writes (byte-level vocabulary). Prompts
are token ids; outputs greedy with EOS ignored.

    .venv/bin/python bench/bench_gateway.py [--quick] [--clients 32] [--requests 128]
        [--system-prompts 8 --system-len 1500 --questions 256]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridserve_cli.bench import driver
from hybridserve_cli.bench.driver import BenchRequest, HttpBackend, LoadSpec
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint
from hybridserve_cli.loadgen import LoadSummary, RequestResult, make_prompts, result_of, run_load, summarize
from hybridserve_cli.stack import Stack as Launcher

START_TIMEOUT_S = 300.0
MODEL_NAME = "bench"


@dataclass(frozen=True, slots=True)
class HttpResult:
    result: RequestResult
    cached_tokens: int


def run_http_load(
    base_url: str, prompts: Sequence[Sequence[int]], clients: int, max_tokens: int
) -> tuple[LoadSummary, list[HttpResult]]:
    """The bench driver's closed loop over the OpenAI HTTP API (streamed /v1/completions): `clients`
    clients send the next prompt as soon as their last one finished."""
    requests = [BenchRequest(len(p), max_tokens, prompt_ids=tuple(p)) for p in prompts]
    record = driver.run(requests, lambda: HttpBackend(base_url, MODEL_NAME), LoadSpec(clients=clients))
    done = [HttpResult(result_of(o), o.cached_tokens) for o in record.outcomes]
    return summarize([r.result for r in done], clients, record.duration_s), done


class Stack:
    """A scheduler, workers and (optionally) a gateway as child processes, on the stack launcher."""

    def __init__(self, model_dir: Path, num_workers: int, worker_flags: Sequence[str], routing: str | None) -> None:
        self.launcher = Launcher(start_timeout_s=START_TIMEOUT_S)
        try:
            scheduler = self.launcher.scheduler()
            self.workers = [
                self.launcher.worker(
                    model_dir, [scheduler], flags=["--device", "cpu", *worker_flags], name=f"worker{i}"
                )
                for i in range(num_workers)
            ]
            self.worker_addresses = [w.address for w in self.workers]
            self.gateway = None
            if routing is not None:
                self.gateway = self.launcher.gateway(self.worker_addresses, flags=[
                    "--model", str(model_dir), "--served-model-name", MODEL_NAME, "--routing", routing,
                ])  # fmt: skip
                self._wait_ready(num_workers)
        except BaseException:
            self.stop()
            raise

    @property
    def http_url(self) -> str:
        assert self.gateway is not None
        return f"http://{self.gateway.address}"

    @property
    def grpc_address(self) -> str:
        assert self.gateway is not None
        return self.gateway.grpc_address

    def _wait_ready(self, num_workers: int) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{self.http_url}/ready", timeout=5) as response:
                if sum(json.loads(response.read())["workers"].values()) >= num_workers:
                    return
            time.sleep(0.1)
        raise RuntimeError("workers not ready behind the gateway")

    def routed(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"{self.http_url}/metrics", timeout=10).read().decode()
        counts: dict[str, float] = {}
        for worker, value in re.findall(
            r'^hybridserve_gateway_routed_total\{.*?worker="([^"]+)".*?\} (\S+)$', text, re.M
        ):
            counts[worker] = counts.get(worker, 0.0) + float(value)
        return counts

    def stop(self) -> None:
        self.launcher.stop()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def overhead(model_dir: Path, args: argparse.Namespace) -> None:
    prompts = make_prompts(args.requests, 16, 128, ModelSpec().vocab_size, seed=1)
    stack = Stack(model_dir, 1, ["--max-num-seqs", str(args.clients)], routing="prefix")
    names = ("direct gRPC", "gateway gRPC", "gateway HTTP")
    runs: dict[str, list[LoadSummary]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [0.0, 0.0, 0.0] for name in names}  # worker, gateway, client seconds
    pids = (stack.workers[0].child.pid, stack.gateway.child.pid) if stack.gateway is not None else ()
    try:
        run_load(stack.worker_addresses[0], prompts[:8], 8, 4)  # warm-up
        order = [*names, *reversed(names)]  # A B C C B A: drift cancels in the mean
        for _ in range(args.rounds):
            for name in order:
                before = [*(cpu_seconds(p) for p in pids), own_cpu_seconds()]
                if name == "direct gRPC":
                    summary = run_load(stack.worker_addresses[0], prompts, args.clients, args.max_tokens)
                elif name == "gateway gRPC":
                    summary = run_load(stack.grpc_address, prompts, args.clients, args.max_tokens)
                else:
                    summary, _ = run_http_load(stack.http_url, prompts, args.clients, args.max_tokens)
                after = [*(cpu_seconds(p) for p in pids), own_cpu_seconds()]
                cpu[name] = [c + a - b for c, a, b in zip(cpu[name], after, before, strict=True)]
                runs[name].append(summary)
    finally:
        stack.stop()
    print(
        f"\n== gateway overhead: 1 worker, {args.clients} closed-loop clients, {args.requests} requests per run,"
        f" {args.max_tokens} tokens each, {len(runs[names[0]])} runs per path (order A B C C B A) =="
    )
    print(
        f"{'path':<14}{'tok/s':>9}{'vs direct':>11}{'TTFT p50 ms':>13}{'vs direct':>11}{'TTFT p95 ms':>13}"
        f"{'failed':>8}   CPU s per 1k tokens: worker / gateway / client"
    )
    base_tps = sum(s.output_tokens_per_s for s in runs[names[0]]) / len(runs[names[0]])
    base_ttft = sum(s.ttft_p50_s or 0 for s in runs[names[0]]) / len(runs[names[0]])
    for name, summaries in runs.items():
        tps = sum(s.output_tokens_per_s for s in summaries) / len(summaries)
        p50 = sum(s.ttft_p50_s or 0 for s in summaries) / len(summaries)
        p95 = sum(s.ttft_p95_s or 0 for s in summaries) / len(summaries)
        failed = sum(s.requests_failed for s in summaries)
        per_k = " / ".join(f"{c * 1000 / max(1, sum(s.output_tokens for s in summaries)):.2f}" for c in cpu[name])
        print(
            f"{name:<14}{tps:>9.1f}{tps / base_tps:>10.3f}x{p50 * 1000:>13.1f}{(p50 - base_ttft) * 1000:>+10.1f}ms"
            f"{p95 * 1000:>13.1f}{failed:>8}   {per_k}"
        )
    errors = {e for summaries in runs.values() for s in summaries for e in s.errors}
    for error in sorted(errors):
        print(f"error: {error}")


def shared_prefix_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(7)
    vocab = ModelSpec().vocab_size
    systems = [[rng.randrange(3, vocab) for _ in range(args.system_len)] for _ in range(args.system_prompts)]
    return [
        rng.choice(systems) + [rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))]
        for _ in range(args.questions)
    ]


def routing(model_dir: Path, args: argparse.Namespace) -> None:
    prompts = shared_prefix_prompts(args)
    flags = [
        "--block-size",
        str(args.block_size),
        "--num-checkpoint-slots",
        str(args.checkpoint_slots),
        "--max-num-seqs",
        str(args.routing_clients),
    ]
    configs = [
        ("1 worker", 1, "prefix"),
        ("2 workers, round robin", 2, "round-robin"),
        ("2 workers, prefix-aware", 2, "prefix"),
    ]
    rows = []
    for name, num_workers, mode in configs:
        stack = Stack(model_dir, num_workers, flags, routing=mode)
        try:
            summary, results = run_http_load(stack.http_url, prompts, args.routing_clients, args.routing_max_tokens)
            split = sorted(stack.routed().values(), reverse=True)
        finally:
            stack.stop()
        ok = [r for r in results if r.result.ok]
        hit = sum(r.cached_tokens for r in ok) / max(1, sum(r.result.prompt_tokens for r in ok))
        hits = sum(r.cached_tokens > 0 for r in ok)
        rows.append((name, hit, hits, len(ok), summary, "/".join(f"{c:.0f}" for c in split)))
    print(
        f"\n== shared-prefix routing: {args.system_prompts} system prompts of {args.system_len} tokens,"
        f" {args.questions} questions of 8-24 tokens, {args.routing_clients} clients,"
        f" {args.routing_max_tokens} tokens each; block {args.block_size}, {args.checkpoint_slots} checkpoint"
        f" slots per worker (a cached prefix holds one: {args.checkpoint_slots} of the {args.system_prompts}"
        f" system prompts fit) =="
    )
    print(
        f"{'configuration':<26}{'hit rate':>9}{'requests hit':>14}{'TTFT p50 ms':>13}{'TTFT p95 ms':>13}"
        f"{'tok/s':>8}{'failed':>8}  requests per worker"
    )
    for name, hit, hits, num_ok, summary, split in rows:
        print(
            f"{name:<26}{hit:>9.1%}{f'{hits}/{num_ok}':>14}{_ms(summary.ttft_p50_s):>13}{_ms(summary.ttft_p95_s):>13}"
            f"{summary.output_tokens_per_s:>8.1f}{summary.requests_failed:>8}  {split}"
        )
    rr, pa = rows[1][4], rows[2][4]
    if rr.ttft_p50_s and pa.ttft_p50_s and rr.ttft_p95_s and pa.ttft_p95_s:
        print(
            f"prefix-aware vs round robin: TTFT p50 {pa.ttft_p50_s / rr.ttft_p50_s:.2f}x,"
            f" p95 {pa.ttft_p95_s / rr.ttft_p95_s:.2f}x; hit rate {rows[2][1]:.1%} vs {rows[1][1]:.1%}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small run (smoke test of the benchmark)")
    parser.add_argument("--part", choices=("all", "overhead", "routing"), default="all")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="A B C C B A sequences of the overhead part")
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=1500)
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--routing-clients", type=int, default=8)
    parser.add_argument("--routing-max-tokens", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument(
        "--checkpoint-slots",
        type=int,
        default=4,
        help="per worker; a cached prompt holds one (at its last block boundary)",
    )
    args = parser.parse_args()
    if args.quick:
        args.clients, args.requests, args.max_tokens = 8, 16, 8
        args.system_prompts, args.system_len, args.questions, args.checkpoint_slots = 4, 512, 24, 4
    return args


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_checkpoint(Path(tmp) / "model", ModelSpec(), seed=0)
        if args.part in ("all", "overhead"):
            overhead(model_dir, args)
        if args.part in ("all", "routing"):
            routing(model_dir, args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
