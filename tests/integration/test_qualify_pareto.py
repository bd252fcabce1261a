"""`hybridserve qualify` with several profiles, on recorded measurements (pure, no processes): the
Pareto table and who dominates whom, each profile's gates, and the --profile settings."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from hybridserve_cli.qualify.command import QualifySettings, parse_profiles, report_text
from hybridserve_cli.qualify.gates import Measurement, evaluate, format_report
from hybridserve_cli.qualify.pareto import pareto, pareto_table

PLAIN = Measurement(
    clients=32, wall_s=10.0, output_tokens=20_000, output_tokens_per_s=2000.0, median_decode_tokens_per_s=60.0,
    ttft_p50_s=0.1, ttft_p95_s=0.4, long_ttft_p50_s=2.0, itl_p99_s=0.30, worst_stall_s=0.5, preemptions=0,
    stalled_steps=0, requests_ok=68, requests_failed=0, chat_ttft_p95_s=0.2,
)  # fmt: skip
# a shorter tail for less throughput, decode speed and long-prompt TTFT
MICRO = replace(PLAIN, output_tokens_per_s=1950.0, median_decode_tokens_per_s=58.0, itl_p99_s=0.12, long_ttft_p50_s=3.0)
SHARE = replace(PLAIN, output_tokens_per_s=2010.0, median_decode_tokens_per_s=61.0, itl_p99_s=0.15)  # better all round
WORSE = replace(MICRO, itl_p99_s=0.2, long_ttft_p50_s=3.5)  # what MICRO does, only worse


def test_the_front_is_who_no_one_dominates() -> None:
    measured = {"baseline": PLAIN, "micro": MICRO, "share": SHARE, "worse": WORSE}
    result = pareto(measured)
    assert result.front == ("micro", "share")  # micro trades throughput and long TTFT for a shorter tail
    assert result.dominates == {"baseline": (), "micro": ("worse",), "share": ("baseline", "worse"), "worse": ()}
    table = pareto_table(measured)
    assert table.splitlines()[0] == "Pareto, 32 clients:"
    assert "long TTFT p50 s" in table and "front: micro, share" in table
    assert "share dominates baseline, worse" in table and "micro dominates worse" in table
    assert table.splitlines()[2].startswith("baseline") and table.splitlines()[2].endswith("share")  # dominated by


def test_without_long_prompts_the_table_leaves_their_ttft_out() -> None:
    measured = {"a": replace(PLAIN, long_ttft_p50_s=None), "b": replace(SHARE, long_ttft_p50_s=None)}
    assert "long TTFT" not in pareto_table(measured) and pareto(measured).front == ("b",)
    assert pareto({"a": PLAIN, "b": PLAIN}).front == ("a", "b")  # equals dominate no one


def test_profiles_are_named_flags_beside_the_candidate() -> None:
    profiles = parse_profiles(["micro=--max-num-prefill-tokens-per-step 512", "share=--prefill-share-mode auto"])
    s = QualifySettings(baseline="--x", profiles=profiles)
    assert s.profile_names == ("baseline", "micro", "share")  # no --candidate: only the named ones
    assert s.flags_of("share") == "--prefill-share-mode auto" and s.flags_of("baseline") == "--x"
    both = QualifySettings(candidate="--y", profiles=profiles)
    assert both.profile_names == ("baseline", "candidate", "micro", "share")
    assert QualifySettings().profile_names == ("baseline", "candidate")  # the baseline against itself
    for bad in (["baseline=--z"], ["micro=--a", "micro=--b"], ["two words=--a"]):
        with pytest.raises(ValueError, match="profile names must be distinct words"):
            QualifySettings(profiles=parse_profiles(bad))
    with pytest.raises(ValueError, match="NAME=FLAGS"):
        parse_profiles(["--max-num-seqs 8"])
    with pytest.raises(ValueError, match="--profile starts a worker"):
        QualifySettings(baseline_worker="a:1", candidate_worker="b:2", profiles=profiles)


def test_the_report_gives_each_profiles_gates_then_the_pareto_table_and_who_passes() -> None:
    s = QualifySettings(baseline="--b", profiles=parse_profiles(["micro=--m", "share=--s"]), rounds=1)
    run = {"clients": 32, "baseline": asdict(PLAIN), "micro": asdict(MICRO), "share": asdict(SHARE)}
    passing = [n for n, m in (("micro", MICRO), ("share", SHARE)) if all(g.passed for g in evaluate(PLAIN, m))]
    text = report_text(s, {"runs": [run], "passing": passing})
    assert "micro [--m] vs baseline:" in text and "share [--s] vs baseline:" in text
    assert format_report([(PLAIN, MICRO)]) in text and format_report([(PLAIN, SHARE)]) in text
    assert pareto_table({"baseline": PLAIN, "micro": MICRO, "share": SHARE}) in text
    assert passing == ["share"]  # micro loses median decode speed, which no gate allows
    assert text.splitlines()[-1] == "profiles that pass every gate against the baseline: share"
