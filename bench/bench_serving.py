"""Serving benchmark: the real stack (scheduler + worker processes) under N closed-loop streaming
clients, side by side with transformers `BambaForCausalLM.generate()` serving the same requests in
static batches of N, and the share of step wall time the worker spends waiting for the scheduler with
asynchronous scheduling on vs off.

Model: a random Bamba (hidden 256, 8 layers, attention at layers 3 and 7, vocab 32000), the one of
bench/bench_model.py. Requests: token-id prompts of mixed lengths, greedy, a fixed number of new tokens
(EOS ignored). Only ratios measured in one run mean anything.

    /work/venv/bin/python bench/bench_serving.py [--quick] [--clients 16,32] [--rounds 2] [--max-tokens 32]

Targets (docs/design.md, How quality is judged): worker aggregate output tokens/s >= 2x transformers at the same
batch size; scheduler wait < 5% of step wall time with async scheduling on.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from bench_model import BENCH_SPEC, StepClock, hf_generate
from transformers import BambaForCausalLM as HFBamba
from transformers.utils import logging as hf_logging

from gpu_worker.api.client import generation_stub
from hybridserve.v1 import generation_pb2
from hybridserve_cli.init_model import write_random_checkpoint
from hybridserve_cli.loadgen import LoadSummary, RequestResult, make_prompts, run_load, summarize
from hybridserve_cli.stack import Stack

START_TIMEOUT_S = 180.0
PROMPT_LEN_MIN, PROMPT_LEN_MAX = 16, 256


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """GetInfo counters of a worker (cumulative since it started)."""

    num_steps: int
    step_wall_seconds: float
    scheduler_wait_seconds: float
    num_preemptions: int
    num_stalled_steps: int

    def minus(self, before: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.num_steps - before.num_steps, self.step_wall_seconds - before.step_wall_seconds,
            self.scheduler_wait_seconds - before.scheduler_wait_seconds,
            self.num_preemptions - before.num_preemptions, self.num_stalled_steps - before.num_stalled_steps,
        )  # fmt: skip

    @property
    def wait_share(self) -> float:
        return self.scheduler_wait_seconds / self.step_wall_seconds if self.step_wall_seconds > 0 else 0.0


def counters(address: str) -> EngineCounters:
    with grpc.insecure_channel(address) as channel:
        info = generation_stub(channel).GetInfo(generation_pb2.GetInfoRequest(), timeout=10)
    return EngineCounters(info.num_steps, info.step_wall_seconds, info.scheduler_wait_seconds,
                          info.num_preemptions, info.num_stalled_steps)  # fmt: skip


def start_worker(model_dir: Path, scheduler: str, async_scheduling: bool, max_num_seqs: int) -> Stack:
    flag = "--async-scheduling" if async_scheduling else "--no-async-scheduling"
    stack = Stack(start_timeout_s=START_TIMEOUT_S)
    try:
        stack.worker(model_dir, [scheduler], flags=["--max-num-seqs", str(max_num_seqs), flag])
    except BaseException:
        stack.stop()
        raise
    return stack


def serve_load(
    address: str, prompts_by_clients: dict[int, list[list[int]]], max_tokens: int
) -> dict[int, tuple[LoadSummary, EngineCounters]]:
    """Every load level through the worker: its summary and the engine counters it added."""
    run_load(address, next(iter(prompts_by_clients.values()))[:2], 2, max_tokens)  # warm-up
    out: dict[int, tuple[LoadSummary, EngineCounters]] = {}
    for clients, prompts in prompts_by_clients.items():
        before = counters(address)
        summary = run_load(address, prompts, clients, max_tokens)
        out[clients] = (summary, counters(address).minus(before))
    return out


def hf_static_batches(hf: HFBamba, prompts: list[list[int]], batch_size: int, max_tokens: int) -> LoadSummary:
    """The same requests through transformers generate(), `batch_size` at a time (left-padded, greedy).

    A static batch is what `batch_size` closed-loop clients get without continuous batching: every
    request in it starts together and the next batch waits for the longest one."""
    results: list[RequestResult] = []
    wall_s = 0.0
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        clock = StepClock()
        start = time.perf_counter()
        hf_generate(hf, batch, max_tokens, clock)
        end = time.perf_counter()
        wall_s += end - start
        decode_s = clock.times[-1] - clock.times[0]
        rate = (max_tokens - 1) / decode_s if max_tokens > 1 and decode_s > 0 else None
        results += [RequestResult(ok=True, prompt_tokens=len(p), completion_tokens=max_tokens,
                                  ttft_s=clock.times[0] - start, e2e_s=end - start, decode_tokens_per_s=rate)
                    for p in batch]  # fmt: skip
    return summarize(results, batch_size, wall_s)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def print_comparison(ours: dict[int, LoadSummary], theirs: dict[int, LoadSummary]) -> None:
    head = f"{'clients':>7} {'side':<13}{'ok/failed':>10}{'out tok/s':>11}{'ratio':>7}{'med decode tok/s':>18}"
    print(head + f"{'TTFT p50 ms':>13}{'TTFT p95 ms':>13}{'e2e p95 ms':>12}")
    for clients, mine in ours.items():
        ref = theirs[clients]
        ratio = mine.output_tokens_per_s / ref.output_tokens_per_s if ref.output_tokens_per_s > 0 else float("nan")
        for side, s, shown in (("hybridserve", mine, f"{ratio:.2f}x"), ("transformers", ref, "")):
            decode = "-" if s.median_decode_tokens_per_s is None else f"{s.median_decode_tokens_per_s:.1f}"
            print(f"{clients:>7} {side:<13}{f'{s.requests_ok}/{s.requests_failed}':>10}"
                  f"{s.output_tokens_per_s:>11.1f}{shown:>7}{decode:>18}"
                  f"{_ms(s.ttft_p50_s):>13}{_ms(s.ttft_p95_s):>13}{_ms(s.e2e_p95_s):>12}")  # fmt: skip
        verdict = "met" if ratio >= 2.0 else "NOT met"
        print(f"{'':>8}aggregate output tokens/s ratio {ratio:.2f}x (target >= 2x: {verdict})")
        for error in mine.errors:
            print(f"{'':>8}error: {error}")


def print_async(on: tuple[LoadSummary, EngineCounters], off: tuple[LoadSummary, EngineCounters]) -> None:
    print(f"{'async scheduling':<18}{'steps':>7}{'step wall s':>13}{'sched wait s':>14}{'wait share':>12}"
          f"{'out tok/s':>11}{'preempt':>9}{'stalled':>9}")  # fmt: skip
    for label, (summary, c) in (("on", on), ("off", off)):
        print(f"{label:<18}{c.num_steps:>7}{c.step_wall_seconds:>13.3f}{c.scheduler_wait_seconds:>14.3f}"
              f"{c.wait_share:>11.1%}{summary.output_tokens_per_s:>12.1f}{c.num_preemptions:>9}"
              f"{c.num_stalled_steps:>9}")  # fmt: skip
    verdict = "met" if on[1].wait_share < 0.05 else "NOT met"
    print(f"scheduler wait share with async on: {on[1].wait_share:.1%} (target < 5%: {verdict}); "
          f"off: {off[1].wait_share:.1%}")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="16,32", help="comma-separated client counts")
    parser.add_argument("--rounds", type=int, default=2, help="requests per level = rounds x clients")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (EOS ignored)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 8 new tokens")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.max_tokens = 1, 8
    return args


def run_benchmark(args: argparse.Namespace, model_dir: Path, scheduler: str) -> None:
    levels = [int(c) for c in args.clients.split(",")]
    prompts = {c: make_prompts(args.rounds * c, PROMPT_LEN_MIN, PROMPT_LEN_MAX, BENCH_SPEC.vocab_size, args.seed + c)
               for c in levels}  # fmt: skip
    print(f"model: hidden 256, 8 layers, attention at (3, 7), vocab 32000; prompts {PROMPT_LEN_MIN}-"
          f"{PROMPT_LEN_MAX} tokens, {args.max_tokens} new tokens, {args.rounds} rounds per level; "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    runs: dict[bool, dict[int, tuple[LoadSummary, EngineCounters]]] = {}
    for async_scheduling in (True, False):
        worker = start_worker(model_dir, scheduler, async_scheduling, max(levels))
        try:
            runs[async_scheduling] = serve_load(worker["worker"].address, prompts if async_scheduling else
                                                {levels[0]: prompts[levels[0]]}, args.max_tokens)  # fmt: skip
        finally:
            worker.stop()
    hf = HFBamba.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_generate(hf, prompts[levels[0]][:2], 2)  # warm-up
    theirs = {c: hf_static_batches(hf, p, c, args.max_tokens) for c, p in prompts.items()}
    print("\n== worker (continuous batching, async scheduling) vs transformers generate() (static batches) ==")
    print_comparison({c: summary for c, (summary, _) in runs[True].items()}, theirs)
    print(f"\n== scheduler wait, {levels[0]} clients ==")
    print_async(runs[True][levels[0]], runs[False][levels[0]])


def main() -> None:
    args = parse_args()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_checkpoint(Path(tmp) / "bench-model", BENCH_SPEC, seed=0, with_tokenizer=False)
        with Stack(start_timeout_s=START_TIMEOUT_S) as stack:
            run_benchmark(args, model_dir, stack.scheduler())


if __name__ == "__main__":
    main()
