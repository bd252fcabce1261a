"""`hybridserve bench`: N closed-loop streaming clients against one worker, then a summary.

Each client is a thread that sends its next request as soon as the previous one finished, so exactly
N requests are in flight until the queue runs dry. `run_load(...) -> LoadSummary` is the reusable
part (bench/bench_serving.py calls it in-process); `summarize` is pure and unit-tested."""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import grpc
from tqdm import tqdm

from gpu_worker.api.client import (
    WorkerTarget,
    build_request,
    describe_rpc_error,
    generation_stub,
    stream_completion,
)
from hybridserve.client_security import (
    ClientSecurity,
    add_client_security_arguments,
    client_security_from_args,
    open_client_channel,
)
from hybridserve.settings import Flag, add_settings_arguments
from hybridserve.stats import percentile
from hybridserve.v1 import generation_pb2, generation_pb2_grpc

FIRST_ORDINARY_TOKEN_ID = 3  # ids 0-2 are pad, bos, eos in the default tokenizer and the Bamba config
MAX_ERRORS_KEPT = 5


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request as one client saw it."""

    ok: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # time to first token, seconds
    e2e_s: float = 0.0  # call start to stream end, seconds
    decode_tokens_per_s: float | None = None  # tokens after the first over their span
    error: str = ""


@dataclass(frozen=True, slots=True)
class LoadSummary:
    """What a load run measured; times in seconds, rates in tokens per second."""

    clients: int
    requests_ok: int
    requests_failed: int
    wall_s: float  # first request sent to last request finished
    output_tokens: int  # completion tokens of the successful requests
    output_tokens_per_s: float  # output_tokens / wall_s: the aggregate throughput
    median_decode_tokens_per_s: float | None  # median over requests of their own decode rate
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    errors: tuple[str, ...] = ()  # the first few distinct error messages


def summarize(results: Sequence[RequestResult], clients: int, wall_s: float) -> LoadSummary:
    """The summary statistics of a run from its per-request results and its wall time."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok]
    decode_rates = [r.decode_tokens_per_s for r in ok if r.decode_tokens_per_s is not None]
    errors: list[str] = []
    for r in results:
        if not r.ok and r.error not in errors and len(errors) < MAX_ERRORS_KEPT:
            errors.append(r.error)
    return LoadSummary(
        clients=clients, requests_ok=len(ok), requests_failed=len(results) - len(ok), wall_s=wall_s,
        output_tokens=output_tokens, output_tokens_per_s=output_tokens / wall_s if wall_s > 0 else 0.0,
        median_decode_tokens_per_s=percentile(decode_rates, 50),
        ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95),
        e2e_p50_s=percentile(e2es, 50), e2e_p95_s=percentile(e2es, 95), errors=tuple(errors),
    )  # fmt: skip


def make_prompts(num_requests: int, len_min: int, len_max: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of uniformly mixed lengths in [len_min, len_max], avoiding the special ids."""
    if not 1 <= len_min <= len_max:
        raise ValueError(f"prompt lengths need 1 <= min <= max, got min={len_min} max={len_max}")
    if vocab_size <= FIRST_ORDINARY_TOKEN_ID:
        raise ValueError(f"vocab_size={vocab_size} leaves no ordinary token ids")
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(rng.randint(len_min, len_max))]
        for _ in range(num_requests)
    ]


class _Queue:
    """Hands out request indices to the clients; thread-safe."""

    def __init__(self, total: int) -> None:
        self._next = 0
        self._total = total
        self._lock = threading.Lock()
        self.stopped = threading.Event()

    def take(self) -> int | None:
        with self._lock:
            if self.stopped.is_set() or self._next >= self._total:
                return None
            self._next += 1
            return self._next - 1


def _one_request(stub: generation_pb2_grpc.GenerationStub, request: generation_pb2.GenerateRequest,
                 address: str, timeout_s: float) -> RequestResult:  # fmt: skip
    try:
        done = stream_completion(stub, request, timeout_s)
    except grpc.RpcError as exc:
        return RequestResult(ok=False, error=describe_rpc_error(exc, address))
    return RequestResult(
        ok=True,
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        ttft_s=done.ttft_s,
        e2e_s=done.e2e_s,
        decode_tokens_per_s=done.decode_tokens_per_s,
    )


def run_load(
    address: str,
    prompts: Sequence[str | Sequence[int]],
    clients: int,
    max_tokens: int,
    *,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    timeout_s: float = 600.0,
    progress: bool = False,
    security: ClientSecurity | None = None,
) -> LoadSummary:
    """Serves every prompt once through `clients` closed-loop streaming clients; returns the summary.

    Ctrl-C stops handing out requests and cancels those in flight (they count as failed)."""
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    queue = _Queue(len(prompts))
    results: list[RequestResult | None] = [None] * len(prompts)
    channels = [open_client_channel(address, security) for _ in range(clients)]
    bar = tqdm(total=len(prompts), unit="req", disable=not progress, file=sys.stderr, dynamic_ncols=True)

    def client(channel: grpc.Channel) -> None:
        stub = generation_stub(channel)
        while (index := queue.take()) is not None:
            request = build_request(prompts[index], max_tokens=max_tokens, ignore_eos=ignore_eos,
                                    temperature=temperature)  # fmt: skip
            results[index] = _one_request(stub, request, address, timeout_s)
            bar.update(1)

    threads = [threading.Thread(target=client, args=(c,), name=f"client-{i}", daemon=True)
               for i, c in enumerate(channels)]  # fmt: skip
    start_s = time.perf_counter()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)
    except KeyboardInterrupt:
        queue.stopped.set()
        for channel in channels:
            channel.close()  # cancels the calls in flight
        for thread in threads:
            thread.join(5.0)
    finally:
        wall_s = time.perf_counter() - start_s
        bar.close()
        for channel in channels:
            channel.close()
    done = [r if r is not None else RequestResult(ok=False, error="not sent (interrupted)") for r in results]
    return summarize(done, clients, wall_s)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def format_table(summary: LoadSummary) -> str:
    """The human-readable summary table."""
    decode = summary.median_decode_tokens_per_s
    rows = [
        ("clients", str(summary.clients)),
        ("requests ok / failed", f"{summary.requests_ok} / {summary.requests_failed}"),
        ("wall time", f"{summary.wall_s:.2f} s"),
        ("output tokens", str(summary.output_tokens)),
        ("aggregate output tok/s", f"{summary.output_tokens_per_s:.1f}"),
        ("median decode tok/s per request", "-" if decode is None else f"{decode:.1f}"),
        ("TTFT p50 / p95", f"{_ms(summary.ttft_p50_s)} / {_ms(summary.ttft_p95_s)}"),
        ("end-to-end p50 / p95", f"{_ms(summary.e2e_p50_s)} / {_ms(summary.e2e_p95_s)}"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += [f"error: {e}" for e in summary.errors]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, WorkerTarget, "BENCH", flags={"worker": Flag("worker address (host:port)")})
    parser.add_argument("--clients", type=int, default=8, help="concurrent closed-loop clients")
    parser.add_argument("--requests", type=int, default=64, help="requests in all")
    parser.add_argument("--prompt-len-min", type=int, default=16, help="shortest prompt, tokens")
    parser.add_argument("--prompt-len-max", type=int, default=256, help="longest prompt, tokens")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--stop-at-eos", action="store_true", help="let requests end at EOS (default: ignore EOS)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token-id prompts")
    parser.add_argument("--vocab-size", type=int, default=0, help="prompt token ids are < this (0: ask the worker)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_client_security_arguments(parser)


def worker_vocab_size(address: str, timeout_s: float = 10.0, security: ClientSecurity | None = None) -> int:
    """The worker's vocabulary size from GetInfo; raises grpc.RpcError when it does not answer."""
    with open_client_channel(address, security) as channel:
        info = generation_stub(channel).GetInfo(generation_pb2.GetInfoRequest(), timeout=timeout_s)
    return int(info.vocab_size)


def run(args: argparse.Namespace) -> int:
    security = client_security_from_args(args)
    try:
        vocab_size = args.vocab_size or worker_vocab_size(args.worker, security=security)
        prompts = make_prompts(args.requests, args.prompt_len_min, args.prompt_len_max, vocab_size, args.seed)
    except grpc.RpcError as exc:
        print(f"error: {describe_rpc_error(exc, args.worker)}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = run_load(args.worker, prompts, args.clients, args.max_tokens, ignore_eos=not args.stop_at_eos,
                       temperature=args.temperature, timeout_s=args.timeout, progress=not args.json,
                       security=security)  # fmt: skip
    print(json.dumps(asdict(summary), indent=2) if args.json else format_table(summary))
    return 0 if summary.requests_failed == 0 else 1
