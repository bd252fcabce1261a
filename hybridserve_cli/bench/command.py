"""`hybridserve bench`: a serving benchmark in vLLM bench serve's terms, against the OpenAI HTTP API
(--base-url, streamed; the default) or the gRPC Generation API (--worker).

    hybridserve bench --base-url http://127.0.0.1:8000 --dataset random --random-input-len 128 \\
        --random-output-len 32 --num-prompts 200 --request-rate 4 --goodput ttft:500 tpot:50 \\
        --save-result result.json --plot plots/

Load: open loop at --request-rate (Poisson; gamma with --burstiness), capped by --max-concurrency,
or closed loop with --clients N; a trace replays on its own clock. The table at the end and the
--save-result JSON use vLLM's names (hybridserve_cli.bench.results); exit code 1 when a request failed."""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from gpu_worker.api.client import describe_rpc_error
from hybridserve.client_security import ClientSecurity, add_client_security_arguments, client_security_from_args
from hybridserve_cli.bench import datasets, driver
from hybridserve_cli.bench.driver import Backend, BenchRequest, GrpcBackend, HttpBackend, LoadSpec
from hybridserve_cli.bench.results import format_table, parse_goodput, summarize

FIRST_ORDINARY_TOKEN_ID = 3  # ids 0-2 are pad, bos, eos in the default tokenizer (gRPC without --tokenizer)
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="the OpenAI HTTP API (a gateway)")
    target.add_argument("--endpoint", default="/v1/completions", choices=sorted(ENDPOINTS), help="streamed API")
    target.add_argument("--model", default="", help="the model name to send (default: the server's /v1/models)")
    target.add_argument("--worker", default="", metavar="HOST:PORT",
                        help="speak gRPC to this worker (or a gateway's gRPC port) instead of HTTP")  # fmt: skip
    target.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                        help="count prompt tokens with this model folder's tokenizer (default: /tokenize)")  # fmt: skip
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", "--requests", dest="num_prompts", type=int, default=100, help="requests in all")
    load.add_argument("--request-rate", type=float, default=math.inf, help="open loop: requests/s (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    load.add_argument("--max-concurrency", type=int, default=0, help="open loop: most requests in flight (0: no cap)")
    load.add_argument("--clients", type=int, default=0, help="closed loop with N clients (overrides --request-rate)")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", choices=datasets.DATASETS)
    data.add_argument("--dataset-path", type=Path, default=None, help="sharegpt JSON or trace JSONL file")
    data.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens")
    data.add_argument("--random-output-len", "--max-tokens", dest="random_output_len", type=int, default=128,
                      help="tokens generated per request (also multiturn's)")  # fmt: skip
    data.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths within len * [1-r, 1+r]")
    data.add_argument("--sharegpt-output-len", type=int, default=0, help="override the replies' lengths")
    data.add_argument("--multiturn-turns", type=int, default=4, help="user turns per conversation")
    data.add_argument("--multiturn-system-prompts", type=int, default=2, help="system prompts shared by all")
    data.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash id")
    data.add_argument("--seed", type=int, default=0, help="of the dataset and the arrivals")
    req = parser.add_argument_group("requests")
    req.add_argument("--stop-at-eos", action="store_true", help="let requests end at EOS (default: ignore EOS)")
    req.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    req.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    out = parser.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    out.add_argument("--save-result", type=Path, default=None, metavar="FILE", help="write the result JSON here")
    out.add_argument("--plot", type=Path, default=None, metavar="DIR", help="latency CDFs and tokens/s (matplotlib)")
    out.add_argument("--json", action="store_true", help="print the result JSON instead of the table")
    add_client_security_arguments(parser)


def served_model(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    """The first model of GET /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            models = json.loads(response.read()).get("data") or []
    except OSError as exc:
        raise ValueError(f"no OpenAI API at {base_url} ({exc}): is the gateway running? (--base-url)") from None
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model yet; retry when a worker is ready, or pass --model")
    return str(models[0]["id"])


def _worker_pool(address: str, security: ClientSecurity) -> list[int]:
    """A gRPC worker's ordinary token ids, from its GetInfo vocabulary size."""
    from gpu_worker.api.client import generation_stub
    from hybridserve.client_security import open_client_channel
    from hybridserve.v1 import generation_pb2

    with open_client_channel(address, security) as channel:
        info = generation_stub(channel).GetInfo(generation_pb2.GetInfoRequest(), timeout=10.0)
    return list(range(FIRST_ORDINARY_TOKEN_ID, int(info.vocab_size)))


def build_requests(args: argparse.Namespace, model: str, security: ClientSecurity) -> list[BenchRequest]:
    """The dataset's requests, counted in the served model's tokens."""
    tokenizer: datasets.Tokenizer | None = None
    if args.tokenizer is not None:
        tokenizer = datasets.LocalTokenizer(args.tokenizer)
    elif not args.worker:
        tokenizer = datasets.ServerTokenizer(args.base_url, model, security.api_key)
    chat = ENDPOINTS[args.endpoint] == "chat" and not args.worker
    if args.dataset in ("sharegpt", "trace") and args.dataset_path is None:
        raise ValueError(f"--dataset {args.dataset} reads a file: give --dataset-path FILE")
    if args.dataset in ("random", "trace"):
        pool = datasets.token_pool(tokenizer, args.seed) if tokenizer else _worker_pool(args.worker, security)
        if args.dataset == "trace":
            return datasets.trace_requests(args.dataset_path, pool, args.trace_block_size, args.seed, args.num_prompts)
        spec = datasets.RandomSpec(args.random_input_len, args.random_output_len, args.random_range_ratio)
        return datasets.random_requests(args.num_prompts, spec, pool, args.seed)
    if tokenizer is None:
        raise ValueError(f"--dataset {args.dataset} over gRPC needs --tokenizer DIR to count its prompts")
    if args.dataset == "sharegpt":
        return datasets.sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, args.seed,
                                          args.sharegpt_output_len, chat)  # fmt: skip
    spec_mt = datasets.MultiturnSpec(turns=args.multiturn_turns, system_prompts=args.multiturn_system_prompts,
                                     output_len=args.random_output_len)  # fmt: skip
    return datasets.multiturn_requests(args.num_prompts, spec_mt, tokenizer, args.seed)


def run_info(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """What the run was, first in the result JSON (vLLM's keys where it has them)."""
    rate = args.request_rate
    return {
        "backend": "grpc" if args.worker else "openai-chat" if ENDPOINTS[args.endpoint] == "chat" else "openai",
        "base_url": args.worker or args.base_url, "model_id": model, "dataset": args.dataset,
        "num_prompts": args.num_prompts, "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency or None, "clients": args.clients or None,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    security = client_security_from_args(args)
    try:
        slos = parse_goodput(args.goodput)
        load = LoadSpec(clients=args.clients, request_rate=args.request_rate, burstiness=args.burstiness,
                        max_concurrency=args.max_concurrency, seed=args.seed)  # fmt: skip
        model = args.model or ("" if args.worker else served_model(args.base_url, security.api_key))
        requests = build_requests(args, model, security)
    except grpc.RpcError as exc:
        print(f"error: {describe_rpc_error(exc, args.worker)}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    in_flight = args.clients or args.max_concurrency or min(len(requests), 512)

    def backend() -> Backend:
        if args.worker:
            return GrpcBackend(args.worker, security, not args.stop_at_eos, args.temperature, args.timeout, in_flight)
        return HttpBackend(args.base_url, model, ENDPOINTS[args.endpoint], security.api_key, not args.stop_at_eos,
                           args.temperature, args.timeout)  # fmt: skip

    record = driver.run(requests, backend, load, progress=not args.json)
    result = summarize(record.outcomes, record.duration_s, slos, **run_info(args, model))
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    if args.save_result is not None:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot is not None:
        print(plot(result, args.plot), file=sys.stderr)
    return 0 if result["failed"] == 0 else 1


def plot(result: dict[str, Any], out_dir: Path) -> str:
    """Latency CDFs (latency_cdf.png) and output tokens/s over time (throughput.png); a message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot: matplotlib is not installed (pip install matplotlib, or the hybridserve[plot] extra); no plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    series = {
        "TTFT": [t * 1000 for t in result["ttfts"] if t is not None],
        "ITL": [g * 1000 for gaps in result["itls"] for g in gaps],
        "E2EL": [e * 1000 for e in result["e2els"]],
    }
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        ordered = sorted(values)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "latency_cdf.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(*tokens_per_second(result))
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s (1 s bins)")
    fig.savefig(out_dir / "throughput.png", dpi=100)
    plt.close(fig)
    return f"plots in {out_dir}/: latency_cdf.png, throughput.png"


def tokens_per_second(result: dict[str, Any], bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Output tokens per bin over the run: each request's tokens spread evenly over its streamed chunks
    (the first at start + TTFT, the next ones ITL apart). Returns (bin starts, tokens/s)."""
    arrivals: list[tuple[float, float]] = []  # (time, tokens)
    for start, ttft, gaps, tokens in zip(result["start_times"], result["ttfts"], result["itls"],
                                         result["output_lens"], strict=True):  # fmt: skip
        if ttft is None:
            continue
        times = [start + ttft]
        for gap in gaps:
            times.append(times[-1] + gap)
        arrivals += [(t, tokens / len(times)) for t in times]
    bins = [0.0] * (int(max((t for t, _ in arrivals), default=0.0) / bin_s) + 1)
    for t, tokens in arrivals:
        bins[int(t / bin_s)] += tokens / bin_s
    return [i * bin_s for i in range(len(bins))], bins


def main_args(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed flags of `hybridserve bench ARGV` (for callers that build a run in-process)."""
    parser = argparse.ArgumentParser(prog="hybridserve bench")
    add_arguments(parser)
    return parser.parse_args(list(argv))
