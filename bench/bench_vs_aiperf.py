"""`hybridserve bench` and AIPerf against one gateway at one request rate: the same random-token
workload (input and output lengths fixed, EOS ignored, streamed /v1/completions), each tool's
request throughput, output throughput and TTFT p50 side by side, and their ratios. The check:
throughput within 5% and TTFT p50 within 10% of each other. Arrivals are constant by default: with
Poisson arrivals each tool draws its own stream, and over 120 requests the realized span alone
moves the measured throughput by ~9% (one standard deviation).

AIPerf lives in its own virtual environment, never the project's:

    python3 -m venv ~/.cache/hybridserve/aiperf-venv
    ~/.cache/hybridserve/aiperf-venv/bin/pip install aiperf==0.13.0
    .venv/bin/python bench/bench_vs_aiperf.py --base-url http://127.0.0.1:8000 --model NAME \\
        --tokenizer MODEL_DIR [--rate 4 --num-prompts 120 --input-len 32 --output-len 8]

AIPerf counts tokens with --tokenizer (a local model folder) and reads the server's usage
(--use-server-token-count); `hybridserve bench` asks the gateway's /tokenize."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

AIPERF = Path(os.path.expanduser("~/.cache/hybridserve/aiperf-venv/bin/aiperf"))


def run_ours(args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "hybridserve_cli", "bench", "--base-url", args.base_url, "--model", args.model,
           "--request-rate", str(args.rate), "--num-prompts", str(args.num_prompts), "--seed", str(args.seed),
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--save-result", str(out)]  # fmt: skip
    if args.arrivals == "constant":  # gamma of shape 10^4: intervals within ~1% of 1/rate
        cmd += ["--burstiness", "10000"]
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    return {"request_throughput": r["request_throughput"], "output_throughput": r["output_throughput"],
            "ttft_p50_ms": r["median_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
            "completed": r["completed"]}  # fmt: skip


def run_aiperf(args: argparse.Namespace, out_dir: Path) -> dict:
    cmd = [str(AIPERF), "profile", "--model", args.model, "--url", args.base_url, "--endpoint-type", "completions",
           "--streaming", "--tokenizer", str(args.tokenizer), "--use-server-token-count",
           "--synthetic-input-tokens-mean", str(args.input_len), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(args.output_len), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--request-rate", str(args.rate), "--arrival-pattern", args.arrivals,
           "--request-count", str(args.num_prompts), "--random-seed", str(args.seed), "--ui-type", "none",
           "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", str(out_dir)]  # fmt: skip
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    print(done.stdout[-6000:])
    r = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    return {"request_throughput": r["request_throughput"]["avg"],
            "output_throughput": r["output_token_throughput"]["avg"],
            "ttft_p50_ms": r["time_to_first_token"]["p50"], "ttft_p99_ms": r["time_to_first_token"]["p99"],
            "completed": r["request_count"]["avg"]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--tokenizer", type=Path, required=True, help="the model folder (AIPerf's tokenizer)")
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--num-prompts", type=int, default=120)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arrivals", choices=("constant", "poisson"), default="constant",
                        help="constant: the tools' own arrival draws cannot move their throughput")  # fmt: skip
    args = parser.parse_args()
    if not AIPERF.exists():
        raise SystemExit(f"no {AIPERF}: install AIPerf into its own venv (see this file's docstring)")
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_ours(args, Path(tmp) / "ours.json")
        theirs = run_aiperf(args, Path(tmp) / "aiperf")
    print(f"{'':<22}{'hybridserve bench':>20}{'aiperf':>14}{'ratio':>10}")
    for key in ("completed", "request_throughput", "output_throughput", "ttft_p50_ms", "ttft_p99_ms"):
        ratio = ours[key] / theirs[key] if theirs[key] else float("nan")
        print(f"{key:<22}{ours[key]:>20.2f}{theirs[key]:>14.2f}{ratio:>10.3f}")
    thr = abs(ours["request_throughput"] / theirs["request_throughput"] - 1)
    ttft = abs(ours["ttft_p50_ms"] / theirs["ttft_p50_ms"] - 1)
    verdict = thr <= 0.05 and ttft <= 0.10
    print(
        f"throughput differs {100 * thr:.1f}% (<= 5%), TTFT p50 {100 * ttft:.1f}% (<= 10%):"
        f" {'ok' if verdict else 'NOT within'}"
    )
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
