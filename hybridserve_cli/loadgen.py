"""Closed-loop gRPC load for in-process callers (bench/bench_serving.py, bench_security.py, ...): N
clients on the bench driver (hybridserve_cli.bench.driver), each sending its next prompt as soon as
its last one finished, and the short summary those benchmarks report. `summarize` is pure and
unit-tested; the `hybridserve bench` command is hybridserve_cli.bench.command."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from gpu_worker.api.client import generation_stub
from hybridserve.client_security import ClientSecurity, open_client_channel
from hybridserve.stats import percentile
from hybridserve.v1 import generation_pb2
from hybridserve_cli.bench import driver
from hybridserve_cli.bench.driver import BenchRequest, GrpcBackend, LoadSpec, RequestOutcome

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
    """Serves every prompt once through `clients` closed-loop gRPC streaming clients (the bench
    driver's closed loop); returns the summary."""
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    requests = [
        BenchRequest(len(p), max_tokens, prompt_text=p) if isinstance(p, str)
        else BenchRequest(len(p), max_tokens, prompt_ids=tuple(p))
        for p in prompts
    ]  # fmt: skip
    record = driver.run(
        requests,
        lambda: GrpcBackend(address, security, ignore_eos, temperature, timeout_s, max_in_flight=clients),
        LoadSpec(clients=clients),
        progress=progress,
    )
    return summarize([result_of(o) for o in record.outcomes], clients, record.duration_s)


def result_of(outcome: RequestOutcome) -> RequestResult:
    """A driver outcome as this module's per-request result."""
    decode = None
    times, counts = outcome.chunk_times_s, outcome.chunk_tokens
    if len(times) >= 2 and times[-1] > times[0]:
        decode = (sum(counts) - counts[0]) / (times[-1] - times[0])
    return RequestResult(
        ok=outcome.ok, prompt_tokens=outcome.prompt_len, completion_tokens=outcome.output_len if outcome.ok else 0,
        ttft_s=outcome.ttft_s, e2e_s=outcome.e2el_s, decode_tokens_per_s=decode, error=outcome.error,
    )  # fmt: skip


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


def worker_vocab_size(address: str, timeout_s: float = 10.0, security: ClientSecurity | None = None) -> int:
    """The worker's vocabulary size from GetInfo; raises grpc.RpcError when it does not answer."""
    with open_client_channel(address, security) as channel:
        info = generation_stub(channel).GetInfo(generation_pb2.GetInfoRequest(), timeout=timeout_s)
    return int(info.vocab_size)
