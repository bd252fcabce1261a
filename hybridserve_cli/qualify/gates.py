"""The qualification gates (docs/design.md, How quality is judged), pure: what one profile measured
on a workload, and the pass/fail of a candidate profile against a baseline on the same workload and
client count.

Gates (candidate vs baseline):
    aggregate output tok/s      no more than `max_throughput_loss` lower
    median decode tok/s         no more than `max_decode_loss` lower (by default: no loss)
    p95 TTFT                    at most `max_ttft_p95_increase` higher (by default: 5%)
    preemptions, stalled steps  zero in the candidate's run
    failed requests             zero in the candidate's run
With several rounds a client count (`qualify --rounds`), a profile's figures are the medians over its
rounds and its counts the sums (`median_measurement`). Beside the gates, not gated: the inter-token
latency tail (p99 gap between streamed tokens and the worst stall) that micro-slicing exists to cut,
the long prompts' median TTFT and, with long prompts, the chats' own p95 TTFT (a convoy's four long
prompts are 6% of its requests: the p95 over all is theirs).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from hybridserve.stats import percentile


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """One request as its client saw it; times in seconds from the run's start."""

    kind: str  # "chat" (closed-loop client) or "long" (a long prompt arriving mid-run)
    ok: bool
    prompt_tokens: int
    completion_tokens: int
    start_s: float  # the call was made
    token_times_s: tuple[float, ...]  # arrival of each streamed message that carried tokens
    token_counts: tuple[int, ...]  # tokens in each of those messages
    end_s: float
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.start_s if self.token_times_s else None

    @property
    def gaps_s(self) -> list[float]:
        """Time between consecutive token-carrying messages (the inter-token latency)."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first message over the time from it to the last; None for one message."""
        if len(self.token_times_s) < 2:
            return None
        span_s = self.token_times_s[-1] - self.token_times_s[0]
        return (sum(self.token_counts) - self.token_counts[0]) / span_s if span_s > 0 else None


@dataclass(frozen=True, slots=True)
class Measurement:
    """One profile on one workload at one client count. Rates in tokens/s, times in seconds."""

    clients: int
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float  # all successful requests' completion tokens / wall_s
    median_decode_tokens_per_s: float  # median over chat requests of their own decode rate
    ttft_p50_s: float
    ttft_p95_s: float  # over every successful request
    long_ttft_p50_s: float | None  # the long prompts' median TTFT (convoy); None without them
    itl_p99_s: float  # p99 of every gap between streamed tokens of chat requests
    worst_stall_s: float  # the longest such gap
    preemptions: int  # the worker's counter over the run
    stalled_steps: int
    requests_ok: int
    requests_failed: int
    # the chats' own p95 TTFT (not gated): in a convoy the long prompts are a few percent of the
    # requests, so the p95 over all of them is a long prompt's TTFT; None before it was measured
    chat_ttft_p95_s: float | None = None


@dataclass(frozen=True, slots=True)
class Tolerances:
    max_throughput_loss: float = 0.03  # fraction of the baseline's aggregate output tok/s
    max_decode_loss: float = 0.0  # fraction of the baseline's median decode tok/s
    max_ttft_p95_increase: float = 0.05  # fraction of the baseline's p95 TTFT


@dataclass(frozen=True, slots=True)
class Gate:
    name: str
    clients: int
    baseline: float
    candidate: float
    passed: bool
    rule: str  # the rule, with its threshold, in words


def measure(traces: Sequence[RequestTrace], clients: int, wall_s: float, preemptions: int, stalled: int) -> Measurement:
    """The measurement of one run from its request traces and the worker's counters over it."""
    ok = [t for t in traces if t.ok]
    chats = [t for t in ok if t.kind == "chat"]
    ttfts = [v for t in ok if (v := t.ttft_s) is not None]
    chat_ttfts = [v for t in chats if (v := t.ttft_s) is not None]
    long_ttfts = [v for t in ok if t.kind == "long" and (v := t.ttft_s) is not None]
    decode = [v for t in chats if (v := t.decode_tokens_per_s) is not None]
    gaps = [g for t in chats for g in t.gaps_s]
    output_tokens = sum(t.completion_tokens for t in ok)
    return Measurement(
        clients=clients, wall_s=wall_s, output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / wall_s if wall_s > 0 else 0.0,
        median_decode_tokens_per_s=percentile(decode, 50) or 0.0,
        ttft_p50_s=percentile(ttfts, 50) or 0.0, ttft_p95_s=percentile(ttfts, 95) or 0.0,
        long_ttft_p50_s=percentile(long_ttfts, 50), itl_p99_s=percentile(gaps, 99) or 0.0,
        worst_stall_s=max(gaps, default=0.0), preemptions=preemptions, stalled_steps=stalled,
        requests_ok=len(ok), requests_failed=len(traces) - len(ok), chat_ttft_p95_s=percentile(chat_ttfts, 95),
    )  # fmt: skip


# Summed over rounds: a gate of zero must see a preemption, stall or failure in any round.
_SUMMED = frozenset({"output_tokens", "preemptions", "stalled_steps", "requests_ok", "requests_failed"})


def median_measurement(rounds: Sequence[Measurement]) -> Measurement:
    """One profile's rounds at one client count as one measurement: the median of each rate and time
    (a round's minute of a noisy machine moves every figure of it alike), the sum of each count
    (output tokens, requests, and the preemptions, stalls and failures the zero gates read)."""
    if not rounds:
        raise ValueError("no rounds to summarize")
    if len({m.clients for m in rounds}) != 1:
        raise ValueError(f"rounds of different client counts: {sorted({m.clients for m in rounds})}")
    values: dict[str, object] = {"clients": rounds[0].clients}
    for field in fields(Measurement):
        name = field.name
        if name == "clients":
            continue
        got = [v for m in rounds if (v := getattr(m, name)) is not None]
        if name in _SUMMED:
            values[name] = sum(got)
        else:
            values[name] = statistics.median(got) if got else None
    return Measurement(**values)  # type: ignore[arg-type]


def round_ratios(pairs: Sequence[tuple[Measurement, Measurement]]) -> str:
    """Each round's candidate / baseline on the figures that move most, for a reader to see the spread
    the medians summarize: `aggregate 0.97 1.02 0.99; median decode ...; p95 TTFT ...; worst stall ...`."""
    figures: list[tuple[str, Callable[[Measurement], float]]] = [
        ("aggregate", lambda m: m.output_tokens_per_s), ("median decode", lambda m: m.median_decode_tokens_per_s),
        ("p95 TTFT", lambda m: m.ttft_p95_s), ("worst stall", lambda m: m.worst_stall_s),
    ]  # fmt: skip
    return "; ".join(
        f"{name} " + " ".join(f"{get(c) / get(b):.2f}" if get(b) else "-" for b, c in pairs) for name, get in figures
    )


def evaluate(baseline: Measurement, candidate: Measurement, tol: Tolerances = Tolerances()) -> list[Gate]:
    """The gates of `candidate` against `baseline` (same workload, same client count)."""
    n = candidate.clients
    b, c = baseline, candidate
    return [
        Gate("aggregate output tok/s", n, b.output_tokens_per_s, c.output_tokens_per_s,
             c.output_tokens_per_s >= b.output_tokens_per_s * (1 - tol.max_throughput_loss),
             f">= baseline - {tol.max_throughput_loss:.0%}"),
        Gate("median decode tok/s", n, b.median_decode_tokens_per_s, c.median_decode_tokens_per_s,
             c.median_decode_tokens_per_s >= b.median_decode_tokens_per_s * (1 - tol.max_decode_loss),
             "no loss" if tol.max_decode_loss == 0 else f">= baseline - {tol.max_decode_loss:.0%}"),
        Gate("p95 TTFT s", n, b.ttft_p95_s, c.ttft_p95_s,
             c.ttft_p95_s <= b.ttft_p95_s * (1 + tol.max_ttft_p95_increase),
             f"<= baseline + {tol.max_ttft_p95_increase:.0%}"),
        Gate("preemptions", n, b.preemptions, c.preemptions, c.preemptions == 0, "0"),
        Gate("stalled steps", n, b.stalled_steps, c.stalled_steps, c.stalled_steps == 0, "0"),
        Gate("failed requests", n, b.requests_failed, c.requests_failed, c.requests_failed == 0, "0"),
    ]  # fmt: skip


def format_report(pairs: Sequence[tuple[Measurement, Measurement]], tol: Tolerances = Tolerances()) -> str:
    """The gates and the latency tail of every client count, as a table; the verdict last."""
    lines = [f"{'gate':<24}{'clients':>8}{'baseline':>12}{'candidate':>12}{'ratio':>8}  {'rule':<20}{'':>5}"]
    verdict = True
    for baseline, candidate in pairs:
        for gate in evaluate(baseline, candidate, tol):
            verdict = verdict and gate.passed
            ratio = f"{gate.candidate / gate.baseline:.3f}" if gate.baseline else "-"
            lines.append(f"{gate.name:<24}{gate.clients:>8}{gate.baseline:>12.3f}{gate.candidate:>12.3f}{ratio:>8}"
                         f"  {gate.rule:<20}{'PASS' if gate.passed else 'FAIL':>5}")  # fmt: skip
        for name, b, c in tail_rows(baseline, candidate):
            ratio = f"{c / b:.3f}" if b else "-"
            lines.append(f"{name:<24}{candidate.clients:>8}{b:>12.3f}{c:>12.3f}{ratio:>8}  (not gated)")
    lines.append(f"verdict: {'PASS' if verdict else 'FAIL'}")
    return "\n".join(lines)


def tail_rows(b: Measurement, c: Measurement) -> list[tuple[str, float, float]]:
    rows = [("ITL p99 s", b.itl_p99_s, c.itl_p99_s), ("worst stall s", b.worst_stall_s, c.worst_stall_s),
            ("TTFT p50 s", b.ttft_p50_s, c.ttft_p50_s)]  # fmt: skip
    if b.long_ttft_p50_s is not None and c.long_ttft_p50_s is not None:
        rows.append(("long-prompt TTFT p50 s", b.long_ttft_p50_s, c.long_ttft_p50_s))
        if b.chat_ttft_p95_s is not None and c.chat_ttft_p95_s is not None:
            rows.append(("chat TTFT p95 s", b.chat_ttft_p95_s, c.chat_ttft_p95_s))
    return rows
