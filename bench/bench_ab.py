"""Two worker configurations side by side in one run: the same checkpoint, two stacks (worker and gateway
each), one with `--a-args`, the other with `--b-args`, both up for the whole run; each round drives them
in turn (who goes first alternating, each run once both are idle) with the same closed-loop streamed
/v1/completions load (bench/http_load.py), EOS ignored. Prints per side the median output tokens/s,
TTFT p50 and ITL p50 over the rounds, every round's tokens/s, and the worker's own mean engine step and
PlanStep round trip over the runs (its Prometheus /metrics: hybridserve_step_seconds,
hybridserve_plan_latency_seconds), then the ratios B / A. What a flag costs or gains served, where an
in-process timing leaves out the server threads that share the cores.

    python bench/bench_ab.py --b-args='--cpu-decode-threads 2' [--a-args=...] [--clients 1] [--rounds 5]
        [--workload random|repeat] [--max-tokens 128] [--prompt-len 64]

Both sides get `--compile-step-sizes auto` unless `--shared-args` says otherwise."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

METRICS = ("hybridserve_step_seconds", "hybridserve_plan_latency_seconds")


def scrape(port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of METRICS on the worker's /metrics at `port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for name in METRICS:
        total = re.search(rf"^{name}_sum(?:\{{[^}}]*\}})? (\S+)", text, re.M)
        count = re.search(rf"^{name}_count(?:\{{[^}}]*\}})? (\S+)", text, re.M)
        out[name] = (float(total.group(1)) if total else 0.0, float(count.group(1)) if count else 0.0)
    return out


def _mean_ms(after: tuple[float, float], before: tuple[float, float]) -> float:
    total, count = after[0] - before[0], after[1] - before[1]
    return total / count * 1000 if count else float("nan")


def parse_args() -> argparse.Namespace:
    from bench_spec import add_load_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-args", default="", help="side A's extra worker flags, one string")
    parser.add_argument("--b-args", default="", help="side B's extra worker flags, one string")
    parser.add_argument("--shared-args", default="--compile-step-sizes auto", help="both sides' worker flags")
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workload", default="random", choices=("random", "repeat"))
    parser.add_argument("--max-num-seqs", type=int, default=0, help="both workers' --max-num-seqs (0: --clients)")
    add_load_args(parser)
    return parser.parse_args()


def main() -> int:
    from bench_spec import WORKLOADS, _ms, _ratio, prompts_for, repeat_prompts, run_load
    from our_stack import start_ours, write_model
    from proc_cpu import wait_quiet

    from hybridserve.children import free_port
    from hybridserve_cli.stack import Stack

    args = parse_args()
    temperature = WORKLOADS[args.workload]
    shared = tuple(shlex.split(args.shared_args))
    print(f"model: hidden {args.hidden_size}, {args.layers} layers, vocab {args.vocab_size}; {args.workload}"
          f" prompts of {args.prompt_len}..{max(args.prompt_len, args.prompt_max)} tokens, {args.max_tokens} new;"
          f" {args.clients} client(s), {args.rounds}"
          f" round(s), who goes first alternating; both: {args.shared_args or '-'}; A: {args.a_args or '-'};"
          f" B: {args.b_args or '-'}", flush=True)  # fmt: skip
    with Stack() as base, tempfile.TemporaryDirectory() as tmp:
        scheduler = base.scheduler()
        model = write_model("granitemoehybrid", args, Path(tmp))
        stacks: dict[str, Any] = {}
        urls: dict[str, str] = {}
        ports: dict[str, int] = {}
        try:
            for side, extra in (("A", args.a_args), ("B", args.b_args)):
                ports[side] = free_port()
                flags = (*shared, *shlex.split(extra), "--metrics-port", str(ports[side]))
                stacks[side], _, urls[side] = start_ours(
                    model, scheduler, args.max_num_seqs or max(args.clients, 1), "auto", 1, flags
                )
            roots = [s.child.pid for st in stacks.values() for s in st.services]
            for url in urls.values():  # a fresh server's first calls stream in bursts
                run_load(url, repeat_prompts(2, 16, args.vocab_size, 99), 2, 8, 0.0)
            prompts = prompts_for(args.workload, args.clients, args)
            before = {side: scrape(port) for side, port in ports.items()}
            runs: dict[str, list[Any]] = {"A": [], "B": []}
            for round_index in range(args.rounds):
                for side in ("A", "B") if round_index % 2 == 0 else ("B", "A"):
                    wait_quiet(roots)
                    runs[side].append(run_load(urls[side], prompts, args.clients, args.max_tokens, temperature))
            after = {side: scrape(port) for side, port in ports.items()}
        finally:
            for stack in stacks.values():
                stack.stop()
    from http_load import median_summary

    medians = {side: median_summary(r) for side, r in runs.items()}
    print(f"\n{'side':<6}{'out tok/s':>11}{'TTFT p50 ms':>13}{'ITL p50 ms':>12}{'step ms':>10}{'plan ms':>10}  rounds")
    for side in ("A", "B"):
        m, step, plan = medians[side], *(_mean_ms(after[side][n], before[side][n]) for n in METRICS)
        rounds = " ".join(f"{r.output_tokens_per_s:.1f}" for r in runs[side])
        print(f"{side:<6}{m.output_tokens_per_s:>11.1f}{_ms(m.ttft_p50_s):>13}{_ms(m.itl_median_s):>12}"
              f"{step:>10.3f}{plan:>10.3f}  {rounds}")  # fmt: skip
    a, b = medians["A"], medians["B"]
    per_round = " ".join(
        _ratio(y.output_tokens_per_s, x.output_tokens_per_s) for x, y in zip(runs["A"], runs["B"], strict=True)
    )
    print(f"B / A: out tok/s {_ratio(b.output_tokens_per_s, a.output_tokens_per_s)}, ITL p50"
          f" {_ratio(b.itl_median_s, a.itl_median_s)}, TTFT p50 {_ratio(b.ttft_p50_s, a.ttft_p50_s)};"
          f" rounds {per_round}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
