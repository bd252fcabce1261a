"""Speculative decoding (n-gram prompt lookup, or the MTP head) on vs off, side by side in one run, at 1,
8 and 32 clients.

Two stacks on the same checkpoint (the benchmark model of bench_vs_vllm.py: random, hidden 256, 8
layers, vocabulary 512; with `--method mtp` a Nemotron-H of that size with an MTP head trained on the
model's own greedy continuations, `init-model --mtp --mtp-train-steps`), one with
`--num-speculative-tokens K`, each a worker and a gateway, both up for the whole run; each cell drives
them in turn (who goes first alternating, each run once both are idle) with the same closed-loop streamed
/v1/completions load (bench/http_load.py), EOS ignored:

    repeat  prompts whose second half repeats their first, greedy: this model's greedy output falls into
            a loop within a few tokens (a greedy loop, as a code edit re-emits its context)
    random  random prompts, sampled at temperature 1: text that does not repeat, where drafts are rare and
            mostly rejected (speculation must then stop itself: a request whose drafts all miss backs off)

Printed per cell: output tokens/s, TTFT p50, ITL p50 for both sides with the ratio on/off, the CPU
milliseconds per output token of each side's processes (worker and gateway: what the tokens cost, where
tokens/s also moves with whatever else the machine's cores do while a run lasts), and the acceptance
rate (accepted / drafted tokens, from the worker's GetInfo counters over the cell's runs); with more than
one round, each round's on/off ratios (tokens/s and CPU per token), their median (rounds are paired:
both sides within a minute of each other, so the median of their ratios is less moved by the machine's
swings than the ratio of each side's median), their geometric mean and its 95% bootstrap interval:
where that interval's low end clears a target, the rounds show it beyond the machine's swings. On a
noisy machine many short rounds read better than a few long
ones: `--rounds 15 --min-requests 2`.

Then, with `--vllm-python` (or $HYBRIDSERVE_VLLM_PYTHON, or ~/.cache/hybridserve/vllm-venv), vLLM's CPU
server at one client with its own speculation of the same method (`--speculative-config`: n-gram with
the same K and n-gram sizes, or MTP with the same K) against our speculating stack, on both workloads;
when vLLM's CPU build refuses speculation, its plain decode, said so.

    python bench/bench_spec.py [--method ngram|mtp] [--clients 1,8,32] [--rounds 3] [--k 4]
        [--max-tokens 128] [--worker-args='--compile-step-sizes auto'] [--skip-vllm]
        [--workloads repeat,random]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORKLOADS = {"repeat": 0.0, "random": 1.0}  # name -> temperature


def repeat_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    from hybridserve_cli.loadgen import make_prompts

    heads = make_prompts(n, length // 2, length // 2, vocab, seed=seed)
    return [h + h for h in heads]


def run_load(url: str, prompts: list[list[int]], clients: int, max_tokens: int, temperature: float) -> Any:
    from http_load import summary_of
    from our_stack import SERVED_NAME

    from hybridserve_cli.bench import driver
    from hybridserve_cli.bench.driver import BenchRequest, HttpBackend, LoadSpec

    requests = [BenchRequest(len(p), max_tokens, prompt_ids=tuple(p)) for p in prompts]
    backend = lambda: HttpBackend(url, SERVED_NAME, temperature=temperature)  # noqa: E731
    return summary_of(driver.run(requests, backend, LoadSpec(clients=clients)), clients)


def spec_counters(address: str) -> tuple[int, int]:
    """(draft tokens verified, accepted) of the worker at `address`, from GetInfo."""
    import grpc

    from hybridserve.v1 import generation_pb2 as pb
    from hybridserve.v1 import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        info = pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest(), timeout=10)
    return info.spec_decode_num_draft_tokens, info.spec_decode_num_accepted_tokens


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def prompts_for(workload: str, clients: int, args: argparse.Namespace) -> list[list[int]]:
    from hybridserve_cli.loadgen import make_prompts

    n = max(args.min_requests, 2 * clients)
    if workload == "repeat":
        return repeat_prompts(n, args.prompt_len, args.vocab_size, args.seed + clients)
    longest = max(args.prompt_len, getattr(args, "prompt_max", 0))
    return make_prompts(n, args.prompt_len, longest, args.vocab_size, seed=args.seed + clients)


def ratio_interval(ratios: list[float], draws: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """(geometric mean, low, high) of paired on/off ratios: the mean of their logarithms and its 95%
    percentile bootstrap interval (rounds resampled with replacement, `draws` times, a fixed seed)."""
    logs = [math.log(r) for r in ratios if r > 0]
    if not logs:
        return math.nan, math.nan, math.nan
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(draws))
    low, high = means[int(0.025 * draws)], means[int(0.975 * draws) - 1]
    return math.exp(statistics.fmean(logs)), math.exp(low), math.exp(high)


def _spread(ratios: list[float]) -> str:
    """Each round's ratio, their median, geometric mean and its 95% bootstrap interval."""
    mean, low, high = ratio_interval(ratios)
    rounds = " ".join(f"{r:.2f}x" for r in ratios)
    return (f"{rounds} (median {statistics.median(ratios):.2f}x; geometric mean {mean:.3f}x, 95% interval"
            f" {low:.3f}x..{high:.3f}x)")  # fmt: skip


def cpu_ms_per_token(cpu_s: list[float], runs: list[Any]) -> list[float]:
    """Each run's CPU milliseconds (its stack's processes) per output token."""
    return [c * 1000 / max(r.output_tokens_per_s * r.wall_s, 1.0) for c, r in zip(cpu_s, runs, strict=True)]


def table(
    args: argparse.Namespace, sides: dict[str, tuple[str, str]], roots: list[int], side_roots: dict[str, list[int]]
) -> None:
    """Every (workload, clients) cell on both sides; `sides`: name -> (gateway URL, worker gRPC address);
    `side_roots`: name -> the pids of that side's services (its CPU seconds)."""
    from http_load import median_summary
    from proc_cpu import tree_cpu_s, wait_quiet

    print(f"\n{'workload':<9}{'clients':>8}{'side':>6}{'out tok/s':>11}{'ratio':>8}{'TTFT p50 ms':>13}"
          f"{'ITL p50 ms':>12}{'ratio':>8}{'CPU ms/tok':>12}{'ratio':>8}{'accepted':>10}{'failed':>8}",
          flush=True)  # fmt: skip
    for workload in args.workloads.split(","):
        temperature = WORKLOADS[workload]
        for clients in (int(c) for c in args.clients.split(",")):
            prompts = prompts_for(workload, clients, args)
            runs: dict[str, list[Any]] = {"off": [], "on": []}
            cpu: dict[str, list[float]] = {"off": [], "on": []}
            before = spec_counters(sides["on"][1])
            for round_index in range(args.rounds):
                for side in ("off", "on") if round_index % 2 == 0 else ("on", "off"):
                    wait_quiet(roots)
                    start = tree_cpu_s(side_roots[side])
                    runs[side].append(run_load(sides[side][0], prompts, clients, args.max_tokens, temperature))
                    cpu[side].append(tree_cpu_s(side_roots[side]) - start)
            drafted, accepted = (b - a for a, b in zip(before, spec_counters(sides["on"][1]), strict=True))
            off, on = median_summary(runs["off"]), median_summary(runs["on"])
            rate = f"{accepted / drafted:.0%}" if drafted else "none"
            per_token = {side: cpu_ms_per_token(cpu[side], runs[side]) for side in runs}
            cpu_ms = {side: statistics.median(v) for side, v in per_token.items()}
            for side, m in (("off", off), ("on", on)):
                ratio = side == "on"
                print(f"{workload:<9}{clients:>8}{side:>6}{m.output_tokens_per_s:>11.1f}"
                      f"{_ratio(on.output_tokens_per_s, off.output_tokens_per_s) if ratio else '':>8}"
                      f"{_ms(m.ttft_p50_s):>13}{_ms(m.itl_median_s):>12}"
                      f"{_ratio(on.itl_median_s, off.itl_median_s) if ratio else '':>8}"
                      f"{cpu_ms[side]:>12.2f}{_ratio(cpu_ms['on'], cpu_ms['off']) if ratio else '':>8}"
                      f"{rate if ratio else '':>10}{m.requests_failed:>8}", flush=True)  # fmt: skip
            if args.rounds > 1:
                paired = [b.output_tokens_per_s / a.output_tokens_per_s if a.output_tokens_per_s else 0.0
                          for a, b in zip(runs["off"], runs["on"], strict=True)]  # fmt: skip
                cpu_paired = [b / a for a, b in zip(per_token["off"], per_token["on"], strict=True)]
                print(f"{'':<23}rounds on/off out tok/s: {_spread(paired)}", flush=True)
                print(f"{'':<23}rounds on/off CPU ms/token: {_spread(cpu_paired)}", flush=True)
            print(f"{'':<23}drafted {drafted}, accepted {accepted}", flush=True)
            for error in off.errors + on.errors:
                print(f"  error: {error}", flush=True)


def vllm_cell(args: argparse.Namespace, model: Path, ours: tuple[str, str], roots: list[int]) -> None:
    """vLLM's server with its n-gram speculation against our speculating stack, one client."""
    from bench_vs_vllm import find_vllm_python, start_vllm_server
    from http_load import median_summary
    from proc_cpu import wait_quiet

    python = find_vllm_python(args.vllm_python)
    if python is None:
        print("\nvLLM: its interpreter was not found (--vllm-python, $HYBRIDSERVE_VLLM_PYTHON, "
              "~/.cache/hybridserve/vllm-venv): no comparison", flush=True)  # fmt: skip
        return
    config: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": args.k}
    if args.method == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.ngram_min,
                  "prompt_lookup_max": args.ngram_max}  # fmt: skip
    max_len = max(args.prompt_len, args.prompt_max) + args.max_tokens + 8
    server, mode = None, f"{'n-gram' if args.method == 'ngram' else 'MTP'} speculation"
    try:
        try:
            server, url = start_vllm_server(
                python, model, max_len, 8, extra=("--speculative-config", json.dumps(config))
            )
        except RuntimeError as exc:
            print(f"\nvLLM refused speculation ({exc}); against its plain decode", flush=True)
            server, url = start_vllm_server(python, model, max_len, 8)
            mode = "plain decode (speculation refused)"
        print(f"\none client, vLLM with {mode} vs hybridserve with --num-speculative-tokens {args.k}", flush=True)
        print(
            f"{'workload':<9}{'side':>13}{'out tok/s':>11}{'ratio':>8}{'TTFT p50 ms':>13}{'ITL p50 ms':>12}{'ratio':>8}"
        )
        for workload in args.workloads.split(","):
            temperature = WORKLOADS[workload]
            prompts = prompts_for(workload, 1, args)
            runs: dict[str, list[Any]] = {"ours": [], "vllm": []}
            for round_index in range(args.rounds):
                for side in ("ours", "vllm") if round_index % 2 == 0 else ("vllm", "ours"):
                    wait_quiet([*roots, server.pid])
                    target = ours[0] if side == "ours" else url
                    runs[side].append(run_load(target, prompts, 1, args.max_tokens, temperature))
            mine, theirs = median_summary(runs["ours"]), median_summary(runs["vllm"])
            for side, m in (("hybridserve", mine), ("vLLM", theirs)):
                first = side == "hybridserve"
                print(f"{workload:<9}{side:>13}{m.output_tokens_per_s:>11.1f}"
                      f"{_ratio(mine.output_tokens_per_s, theirs.output_tokens_per_s) if first else '':>8}"
                      f"{_ms(m.ttft_p50_s):>13}{_ms(m.itl_median_s):>12}"
                      f"{_ratio(mine.itl_median_s, theirs.itl_median_s) if first else '':>8}", flush=True)  # fmt: skip
    finally:
        if server is not None:
            server.stop()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,8,32", help="closed-loop client counts")
    parser.add_argument("--rounds", type=int, default=3, help="runs a cell on each side (median)")
    parser.add_argument("--workloads", default="repeat,random", help="which of repeat, random")
    parser.add_argument("--method", default="ngram", choices=("ngram", "mtp"), help="--speculative-method")
    parser.add_argument("--mtp-train-steps", type=int, default=300, help="--method mtp: the head's training steps")
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens of the speculating side")
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--decode-compile", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--worker-args", default="", help="more flags for both sides' workers, one string")
    parser.add_argument("--vllm-python", help="vLLM's interpreter (see bench_vs_vllm.py)")
    parser.add_argument("--skip-vllm", action="store_true")
    add_load_args(parser)
    return parser.parse_args()


def add_load_args(parser: argparse.ArgumentParser) -> None:
    """The requests' and the benchmark model's flags (prompts_for, our_stack.write_model), shared with
    bench_ab.py."""
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (EOS ignored)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument(
        "--prompt-max",
        type=int,
        default=0,
        help="random prompts of --prompt-len..this many tokens (0: all of --prompt-len)",
    )
    parser.add_argument("--min-requests", type=int, default=4, help="requests per run at least (else 2 a client)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--init-std", type=float, default=0.06)
    parser.add_argument("--seed", type=int, default=0)


def main() -> int:
    from our_stack import start_ours, write_model

    from hybridserve_cli.stack import Stack

    args = parse_args()
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"--workloads: {', '.join(sorted(unknown))} unknown; choose from {', '.join(WORKLOADS)}")
    max_seqs = max(int(c) for c in args.clients.split(","))
    spec = ("--num-speculative-tokens", str(args.k), "--speculative-method", args.method, "--ngram-min",
            str(args.ngram_min), "--ngram-max", str(args.ngram_max))  # fmt: skip
    with Stack() as base, tempfile.TemporaryDirectory() as tmp:
        scheduler = base.scheduler()
        if args.method == "mtp":
            # dense: vLLM's CPU build serves no Nemotron-H MoE (its non-gated experts are CUDA-only), and its
            # MTP head implements attention and MoE layers only, so its side falls back to plain decode
            from hybridserve_cli.demo_model.mtp_head import train_mtp_head

            model = write_model("nemotron_h", args, Path(tmp), mtp=True)
            loss = train_mtp_head(model, args.mtp_train_steps)
            about = f"Nemotron-H with an MTP head ({args.mtp_train_steps} training steps, loss {loss:.2f})"
        else:
            model = write_model("granitemoehybrid", args, Path(tmp))
            about = f"Granite; n-gram {args.ngram_min}..{args.ngram_max}"
        print(f"model: hidden {args.hidden_size}, {args.layers} layers, vocab {args.vocab_size}; prompts of "
              f"{args.prompt_len} tokens, {args.max_tokens} new; K = {args.k}, {about}; "
              f"{args.rounds} round(s) a cell, who goes first alternating; worker flags: {args.worker_args or '-'}",
              flush=True)  # fmt: skip
        stacks: dict[str, Any] = {}
        sides: dict[str, tuple[str, str]] = {}
        try:
            extra = tuple(shlex.split(args.worker_args))
            for side, flags in (("off", extra), ("on", (*extra, *spec))):
                stack, worker, url = start_ours(model, scheduler, max_seqs, args.decode_compile, 1, flags)
                stacks[side], sides[side] = stack, (url, worker)
            side_roots = {side: [s.child.pid for s in st.services] for side, st in stacks.items()}
            roots = [pid for pids in side_roots.values() for pid in pids]
            for url, _ in sides.values():  # a fresh server's first calls stream in bursts
                run_load(url, repeat_prompts(2, 16, args.vocab_size, 99), 2, 8, 0.0)
            table(args, sides, roots, side_roots)
            if not args.skip_vllm:
                vllm_cell(args, model, sides["on"], roots)
        finally:
            for stack in stacks.values():
                stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
