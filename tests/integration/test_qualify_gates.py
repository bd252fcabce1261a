"""`hybridserve qualify`'s gates, computed from a known set of measurements (pure, no processes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridserve_cli.qualify.gates import (
    Measurement,
    RequestTrace,
    Tolerances,
    evaluate,
    format_report,
    measure,
    median_measurement,
    round_ratios,
)


def trace(
    kind: str, start: float, times: list[float], counts: list[int] | None = None, ok: bool = True
) -> RequestTrace:
    counts = counts or [1] * len(times)
    return RequestTrace(kind, ok, 10, sum(counts) if ok else 0, start, tuple(times), tuple(counts),
                        times[-1] if times else start)  # fmt: skip


def test_measure_from_known_traces() -> None:
    traces = [
        trace("chat", 0.0, [0.5, 0.6, 0.7, 0.8]),  # TTFT 0.5; gaps 0.1 x3; decode 3 tokens / 0.3 s
        trace("chat", 0.0, [1.0, 1.2, 1.4], [2, 1, 1]),  # TTFT 1.0; gaps 0.2 x2; decode 2 / 0.4 s
        trace("long", 0.2, [2.2, 3.2]),  # TTFT 2.0; its gap (1.0) is not a chat gap
        trace("chat", 0.0, [], ok=False),
    ]
    m = measure(traces, clients=2, wall_s=4.0, preemptions=1, stalled=0)
    assert m.output_tokens == 4 + 4 + 2
    assert m.output_tokens_per_s == pytest.approx(10 / 4.0)
    assert m.median_decode_tokens_per_s == pytest.approx((10.0 + 5.0) / 2)
    assert m.ttft_p50_s == pytest.approx(1.0)
    assert m.ttft_p95_s == pytest.approx(1.0 + 0.9 * (2.0 - 1.0))  # linear between the ranks of 1.0 and 2.0
    assert m.long_ttft_p50_s == pytest.approx(2.0)
    assert m.chat_ttft_p95_s == pytest.approx(0.5 + 0.95 * (1.0 - 0.5))  # the chats' only: the long one's 2.0 is out
    assert m.worst_stall_s == pytest.approx(0.2)
    assert m.itl_p99_s == pytest.approx(0.2)
    assert (m.requests_ok, m.requests_failed, m.preemptions, m.stalled_steps) == (3, 1, 1, 0)


BASE = Measurement(
    clients=16, wall_s=10.0, output_tokens=10_000, output_tokens_per_s=1000.0, median_decode_tokens_per_s=50.0,
    ttft_p50_s=0.1, ttft_p95_s=0.2, long_ttft_p50_s=None, itl_p99_s=0.05, worst_stall_s=0.3, preemptions=0,
    stalled_steps=0, requests_ok=64, requests_failed=0,
)  # fmt: skip


def verdicts(candidate: Measurement, tol: Tolerances | None = None) -> dict[str, bool]:
    return {g.name: g.passed for g in evaluate(BASE, candidate, tol or Tolerances())}


def test_identical_measurements_pass_every_gate() -> None:
    assert all(verdicts(BASE).values())
    assert format_report([(BASE, BASE)]).endswith("verdict: PASS")


@pytest.mark.parametrize(
    ("change", "gate", "passed"),
    [
        ({"output_tokens_per_s": 970.0}, "aggregate output tok/s", True),  # exactly 3% lower
        ({"output_tokens_per_s": 969.0}, "aggregate output tok/s", False),
        ({"median_decode_tokens_per_s": 49.99}, "median decode tok/s", False),  # no loss allowed
        ({"median_decode_tokens_per_s": 60.0}, "median decode tok/s", True),
        ({"ttft_p95_s": 0.21}, "p95 TTFT s", True),  # exactly 5% higher
        ({"ttft_p95_s": 0.2101}, "p95 TTFT s", False),
        ({"preemptions": 1}, "preemptions", False),
        ({"stalled_steps": 2}, "stalled steps", False),
        ({"requests_failed": 1}, "failed requests", False),
        ({"worst_stall_s": 9.0, "itl_p99_s": 9.0}, "aggregate output tok/s", True),  # the tail is not gated
    ],
)
def test_each_gate_at_its_threshold(change: dict[str, float], gate: str, passed: bool) -> None:
    result = verdicts(replace(BASE, **change))
    assert result[gate] is passed
    assert all(v for name, v in result.items() if name != gate)
    report = format_report([(BASE, replace(BASE, **change))])
    assert report.endswith("verdict: PASS" if passed else "verdict: FAIL")


def test_tolerances_are_settings() -> None:
    loose = Tolerances(max_throughput_loss=0.2, max_decode_loss=0.1, max_ttft_p95_increase=0.5)
    candidate = replace(BASE, output_tokens_per_s=850.0, median_decode_tokens_per_s=46.0, ttft_p95_s=0.29)
    assert all(verdicts(candidate, loose).values())
    assert not any(v for k, v in verdicts(candidate).items() if k in ("aggregate output tok/s", "p95 TTFT s"))


def test_warmup_runs_are_a_setting_that_rejects_negatives() -> None:
    from hybridserve_cli.qualify.command import QualifySettings

    assert QualifySettings().warmup_runs == 1 and QualifySettings(warmup_runs=0).warmup_runs == 0
    with pytest.raises(ValueError, match="--warmup-runs must be >= 0"):
        QualifySettings(warmup_runs=-1)


def test_with_long_prompts_the_report_shows_their_ttft_and_the_chats_p95_apart() -> None:
    """Not gated: a convoy's report carries the long prompts' median TTFT and the chats' own p95 TTFT
    (the p95 over every request is a long prompt's where they are over 5% of the requests)."""
    convoy = replace(BASE, long_ttft_p50_s=3.0, chat_ttft_p95_s=0.4)
    slower = replace(convoy, long_ttft_p50_s=3.6, chat_ttft_p95_s=0.3)
    rows = [line.split() for line in format_report([(convoy, slower)]).splitlines()]
    assert ["long-prompt", "TTFT", "p50", "s", "16", "3.000", "3.600", "1.200", "(not", "gated)"] in rows
    assert ["chat", "TTFT", "p95", "s", "16", "0.400", "0.300", "0.750", "(not", "gated)"] in rows
    assert "chat TTFT p95" not in format_report([(BASE, BASE)])  # chats only: the same as p95 TTFT
    assert all(verdicts(slower).values())


def test_rounds_give_the_median_of_each_figure_and_the_sum_of_each_count() -> None:
    """`--rounds`: a profile's rounds at one client count gate as their medians (one slow minute moves
    one round, not the verdict); a preemption, stall or failure in any round still fails its gate."""
    rounds = [
        replace(BASE, output_tokens_per_s=900.0, ttft_p95_s=0.3, worst_stall_s=0.5, long_ttft_p50_s=2.0),
        replace(BASE, output_tokens_per_s=1000.0, ttft_p95_s=0.1, worst_stall_s=0.2, long_ttft_p50_s=None),
        replace(BASE, output_tokens_per_s=1300.0, ttft_p95_s=0.2, worst_stall_s=0.4, preemptions=2,
                requests_failed=1, long_ttft_p50_s=4.0),
    ]  # fmt: skip
    m = median_measurement(rounds)
    assert (m.output_tokens_per_s, m.ttft_p95_s, m.worst_stall_s) == (1000.0, 0.2, 0.4)
    assert m.long_ttft_p50_s == 3.0  # the median of the rounds that measured one
    assert m.chat_ttft_p95_s is None  # no round measured it
    assert (m.output_tokens, m.requests_ok, m.requests_failed, m.preemptions) == (30_000, 192, 1, 2)
    verdict = {g.name: g.passed for g in evaluate(BASE, m)}
    assert verdict["aggregate output tok/s"] and verdict["p95 TTFT s"]
    assert not verdict["preemptions"] and not verdict["failed requests"]
    assert median_measurement([BASE]) == BASE  # one round: the run itself
    with pytest.raises(ValueError, match="different client counts"):
        median_measurement([BASE, replace(BASE, clients=32)])
    ratios = round_ratios([(BASE, rounds[0]), (BASE, rounds[1])])
    assert ratios.startswith("aggregate 0.90 1.00; median decode 1.00 1.00; p95 TTFT 1.50 0.50; ")
    assert ratios.endswith("worst stall 1.67 0.67")


def test_rounds_is_a_setting_of_at_least_one() -> None:
    from hybridserve_cli.qualify.command import QualifySettings

    assert QualifySettings().rounds == 3 and QualifySettings(rounds=1).rounds == 1
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        QualifySettings(rounds=0)


def test_the_report_of_several_rounds_shows_each_rounds_ratios_under_the_medians_gates() -> None:
    from dataclasses import asdict

    from hybridserve_cli.qualify.command import QualifySettings, report_text

    slow, fast = replace(BASE, output_tokens_per_s=800.0), replace(BASE, output_tokens_per_s=1100.0)
    rounds = [{"baseline": asdict(BASE), "candidate": asdict(slow)},
              {"baseline": asdict(BASE), "candidate": asdict(fast)},
              {"baseline": asdict(BASE), "candidate": asdict(BASE)}]  # fmt: skip
    summary = median_measurement([slow, fast, BASE])
    result = {"runs": [{"clients": 16, "baseline": asdict(BASE), "candidate": asdict(summary), "rounds": rounds}],
              "passing": ["candidate"]}  # fmt: skip
    text = report_text(QualifySettings(rounds=3, baseline="--a", candidate="--b"), result)
    lines = text.splitlines()
    assert lines[1] == "3 rounds a client count, who goes first alternating; figures: each profile's median"
    assert format_report([(BASE, summary)]) in text and "verdict: PASS" in text  # the median round: 1000
    (each,) = [line for line in lines if line.startswith("rounds at ")]
    assert each.startswith("rounds at 16 clients, candidate / baseline: aggregate 0.80 1.10 1.00; ")
    assert lines[-1] == "profiles that pass every gate against the baseline: candidate"
    single = {"runs": [{"clients": 16, "baseline": asdict(BASE), "candidate": asdict(BASE)}], "passing": []}
    assert "rounds at" not in report_text(QualifySettings(rounds=1), single)


def test_chats_may_ask_for_seeded_varied_lengths_with_the_same_prompts() -> None:
    """--max-tokens-min: each chat's new tokens seeded uniform in [min, --max-tokens] (chats of one
    length finish together and a closed loop sends the next ones in a wave); the prompts stay those
    of the fixed-length workload; 0 (the default) is every chat at --max-tokens."""
    from hybridserve_cli.qualify.command import QualifySettings
    from hybridserve_cli.qualify.workload import Workload

    fixed, varied = Workload(requests=200, max_tokens=64), Workload(requests=200, max_tokens=64, max_tokens_min=16)
    assert fixed.chat_max_tokens() == [64] * 200
    lengths = varied.chat_max_tokens()
    assert lengths == varied.chat_max_tokens() and min(lengths) >= 16 and max(lengths) <= 64
    assert len(set(lengths)) > 30 and min(lengths) < 24 and max(lengths) > 56  # spread over the range
    assert varied.prompts(512) == fixed.prompts(512)
    assert QualifySettings(max_tokens_min=16).workload_spec().chat_max_tokens() == lengths[:64]
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="--max-tokens-min must be 0"):
            QualifySettings(max_tokens_min=bad)
