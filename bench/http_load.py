"""Closed-loop HTTP load on an OpenAI-compatible `/v1/completions` (streamed, greedy, EOS ignored), on
the bench driver (hybridserve_cli.bench.driver): the same generator drives vLLM's OpenAI server and
the hybridserve gateway in bench_vs_vllm.py.

N clients each send their next request as soon as the previous stream ended. A request's TTFT is
the time to its first SSE chunk carrying a choice; its inter-token latency (ITL) is the time from
that chunk to its last one over the tokens in between, so servers that deliver chunks in bursts
(vLLM's output process at low load) and servers that deliver one per step compare fairly; the
table reports the median over requests."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from hybridserve.stats import percentile
from hybridserve_cli.bench import driver
from hybridserve_cli.bench.driver import BenchRequest, HttpBackend, LoadSpec, RequestOutcome, RunRecord


@dataclass(frozen=True, slots=True)
class HttpResult:
    ok: bool
    completion_tokens: int
    ttft_s: float | None
    itl_s: float | None  # (last chunk - first chunk) / (completion tokens - 1)
    error: str = ""


@dataclass(frozen=True, slots=True)
class HttpSummary:
    clients: int
    requests_ok: int
    requests_failed: int
    wall_s: float
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_median_s: float | None
    errors: tuple[str, ...]


def _result(outcome: RequestOutcome) -> HttpResult:
    times = outcome.chunk_times_s
    tokens = outcome.output_len
    itl = (times[-1] - times[0]) / (tokens - 1) if len(times) >= 2 and tokens > 1 else None
    return HttpResult(outcome.ok, tokens if outcome.ok else 0, outcome.ttft_s, itl, outcome.error)


def summary_of(record: RunRecord, clients: int) -> HttpSummary:
    results = [_result(o) for o in record.outcomes]
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [r.itl_s for r in ok if r.itl_s is not None]
    errors = tuple(dict.fromkeys(r.error for r in results if not r.ok))[:3]
    wall_s = record.duration_s
    return HttpSummary(
        clients=clients, requests_ok=len(ok), requests_failed=len(results) - len(ok), wall_s=wall_s,
        output_tokens_per_s=sum(r.completion_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95), itl_median_s=percentile(itls, 50),
        errors=errors,
    )  # fmt: skip


def median_summary(runs: Sequence[HttpSummary]) -> HttpSummary:
    """Several runs of one cell as one: each figure the median over the runs that have it (a machine's
    slow minute then moves one run, not the cell), requests and failures summed, errors joined."""

    def median(values: Sequence[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    return HttpSummary(
        clients=runs[0].clients, requests_ok=sum(r.requests_ok for r in runs),
        requests_failed=sum(r.requests_failed for r in runs), wall_s=sum(r.wall_s for r in runs),
        output_tokens_per_s=statistics.median(r.output_tokens_per_s for r in runs),
        ttft_p50_s=median([r.ttft_p50_s for r in runs]), ttft_p95_s=median([r.ttft_p95_s for r in runs]),
        itl_median_s=median([r.itl_median_s for r in runs]),
        errors=tuple(dict.fromkeys(e for r in runs for e in r.errors))[:3],
    )  # fmt: skip


def run_http_load(url: str, model: str, prompts: Sequence[list[int]], clients: int, max_tokens: int) -> HttpSummary:
    """Serves every prompt once through `clients` closed-loop streaming clients (the bench driver)."""
    requests = [BenchRequest(len(p), max_tokens, prompt_ids=tuple(p)) for p in prompts]
    record = driver.run(requests, lambda: HttpBackend(url, model), LoadSpec(clients=clients))
    return summary_of(record, clients)


async def _ready(url: str, timeout_s: float, alive: Callable[[], bool], path: str) -> bool:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline and alive():
            try:
                async with session.get(f"{url}{path}") as resp:
                    if resp.status == 200:
                        return True
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(1.0)
    return False


def wait_http_ready(
    url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True, path: str = "/v1/models"
) -> bool:
    """Polls GET `path` (/v1/models: the server is up; our gateway's /ready: a worker behind it is ready)
    until it answers 200 (True), or timeout_s passes or `alive()` turns False (the server's process ended:
    False)."""
    return asyncio.run(_ready(url, timeout_s, alive, path))
