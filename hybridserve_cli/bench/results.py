"""What a run measured, in vLLM bench serve's terms and JSON key names, plus the prefix-cache share.

    request_throughput      completed requests / duration (req/s)
    output_throughput       generated tokens / duration (tok/s)
    total_token_throughput  (prompt + generated tokens) / duration
    TTFT                    send to the first token-carrying chunk (ms)
    TPOT                    (E2EL - TTFT) / (output tokens - 1), per request (ms)
    ITL                     gaps between successive token-carrying chunks, over all requests (ms)
    E2EL                    send to the stream's end (ms)
    request_goodput         requests meeting every --goodput SLO / duration (vLLM: a request is good
                            when each named metric is <= its bound in ms)

Each latency has mean_, median_, std_, p90_ and p99_ keys (`mean_ttft_ms`, ...). Pure: unit-tested
on recorded per-request timings."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from hybridserve.stats import percentile
from hybridserve_cli.bench.driver import RequestOutcome

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
LATENCIES = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)
MAX_ERRORS_KEPT = 5


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`ttft:MS tpot:MS e2el:MS` (vLLM's --goodput syntax) -> {"ttft": ms, ...}."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {item!r}: use NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: the bound must be >= 0 ms")
    return slos


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def request_latencies_ms(outcome: RequestOutcome) -> dict[str, float | None]:
    """The request's TTFT, TPOT and E2EL in ms (None where undefined: no token, or one token for TPOT)."""
    return {"ttft": _ms(outcome.ttft_s), "tpot": _ms(outcome.tpot_s), "e2el": _ms(outcome.e2el_s)}


def is_good(outcome: RequestOutcome, slos: Mapping[str, float]) -> bool:
    """A completed request meets every SLO; an undefined TPOT (one output token) meets its bound."""
    if not outcome.ok:
        return False
    values = request_latencies_ms(outcome)
    for name, bound in slos.items():
        value = values[name]
        if value is None and name == "tpot":
            continue
        if value is None or value > bound:
            return False
    return True


def _stats(prefix: str, values_ms: Sequence[float]) -> dict[str, float]:
    out = {
        f"mean_{prefix}_ms": statistics.fmean(values_ms) if values_ms else 0.0,
        f"median_{prefix}_ms": percentile(values_ms, 50) or 0.0,
        f"std_{prefix}_ms": statistics.pstdev(values_ms) if values_ms else 0.0,
    }
    for p in PERCENTILES:
        out[f"p{p}_{prefix}_ms"] = percentile(values_ms, p) or 0.0
    return out


def summarize(outcomes: Sequence[RequestOutcome], duration_s: float, slos: Mapping[str, float] | None = None,
              **run_info: Any) -> dict[str, Any]:  # fmt: skip
    """The result JSON: vLLM's keys (and the per-request lists of its detailed output), ours after them.
    `run_info` (request_rate, max_concurrency, ...) is copied in first."""
    ok = [o for o in outcomes if o.ok]
    input_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_len for o in ok)
    cached_tokens = sum(o.cached_tokens for o in ok)
    per = max(duration_s, 1e-9)
    samples: dict[str, list[float]] = {
        "ttft": [v for o in ok if (v := _ms(o.ttft_s)) is not None],
        "tpot": [v for o in ok if (v := _ms(o.tpot_s)) is not None],
        "itl": [g * 1000.0 for o in ok for g in o.itls_s],
        "e2el": [o.e2el_s * 1000.0 for o in ok],
    }
    errors: list[str] = []
    for o in outcomes:
        if not o.ok and o.error not in errors and len(errors) < MAX_ERRORS_KEPT:
            errors.append(o.error)
    result: dict[str, Any] = dict(run_info)
    result.update(
        duration=duration_s, completed=len(ok), failed=len(outcomes) - len(ok),
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=len(ok) / per, output_throughput=output_tokens / per,
        total_token_throughput=(input_tokens + output_tokens) / per,
    )  # fmt: skip
    if slos:
        result["goodput_slos_ms"] = dict(slos)
        result["request_goodput"] = sum(is_good(o, slos) for o in outcomes) / per
    else:
        result["request_goodput"] = None
    for name in LATENCIES:
        result.update(_stats(name, samples[name]))
    result["total_cached_prompt_tokens"] = cached_tokens
    result["cached_prompt_token_share"] = cached_tokens / input_tokens if input_tokens else 0.0
    result["errors"] = errors
    result["input_lens"] = [o.prompt_len for o in outcomes]
    result["output_lens"] = [o.output_len for o in outcomes]
    result["ttfts"] = [o.ttft_s for o in outcomes]
    result["itls"] = [o.itls_s for o in outcomes]
    result["start_times"] = [o.start_s for o in outcomes]
    result["e2els"] = [o.e2el_s for o in outcomes]
    result["cached_tokens"] = [o.cached_tokens for o in outcomes]
    return result


_LABELS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}  # fmt: skip


def format_table(result: Mapping[str, Any]) -> str:
    """vLLM bench serve's end-of-run table."""
    rows: list[tuple[str, str]] = [
        ("Successful requests", str(result["completed"])),
        ("Failed requests", str(result["failed"])),
        ("Benchmark duration (s)", f"{result['duration']:.2f}"),
        ("Total input tokens", str(result["total_input_tokens"])),
        ("Total generated tokens", str(result["total_output_tokens"])),
        ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", f"{result['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}"),
        ("Cached prompt tokens", f"{result['total_cached_prompt_tokens']} "
                                 f"({100 * result['cached_prompt_token_share']:.1f}%)"),
    ]  # fmt: skip
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{name:<44}{value:>16}" for name, value in rows]
    for key in LATENCIES:
        lines.append("{s:{c}^60}".format(s=f" {_LABELS[key]} ", c="-"))
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
            label = f"{stat.capitalize() if stat[0] != 'p' else 'P' + stat[1:]} {key.upper()} (ms)"
            lines.append(f"{label:<44}{result[f'{stat}_{key}_ms']:>16.2f}")
    lines.append("=" * 60)
    lines += [f"error: {e}" for e in result.get("errors", [])]
    return "\n".join(lines)
