"""`hybridserve qualify` for real: one short run of three profiles (a scheduler and three workers
started by the command, on a tiny random model), checked through `--json` and `--plot`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridserve_cli.qualify.gates import Measurement, evaluate, median_measurement
from hybridserve_cli.qualify.pareto import pareto
from hybridserve_cli.qualify.workload import Workload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qualify") / "model"
    subprocess.run([sys.executable, "-m", "hybridserve_cli", "init-model", str(folder), "--random"], check=True,
                   timeout=120, capture_output=True)  # fmt: skip
    return folder


def test_two_profiles_on_one_workload_give_gates_per_client_count(tiny_model: Path, tmp_path: Path) -> None:
    plots = tmp_path / "plots"
    done = subprocess.run(
        [sys.executable, "-m", "hybridserve_cli", "qualify", "--model", str(tiny_model),
         "--baseline=--max-num-prefill-tokens-per-step 0", "--candidate=--max-num-prefill-tokens-per-step 64",
         "--profile", "share=--prefill-share-mode fixed --prefill-share 0.3",
         "--common=--no-prefix-caching --max-num-batched-tokens 128 --block-size 64 --mamba-block-size 32",
         "--workload", "convoy", "--clients", "2,3", "--rounds", "2", "--requests", "6", "--prompt-len-max", "48",
         "--max-tokens", "6", "--max-tokens-min", "3", "--long-prompts", "1", "--long-prompt-len", "300",
         "--long-max-tokens", "3", "--long-after-s", "0.05", "--warmup-requests", "2", "--json", "--plot", str(plots)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 0: every gate passed, 1: one failed; 2 = no run
    profiles = ("baseline", "candidate", "share")
    for profile in profiles:  # the untimed pass of the workload before the measured runs
        assert f"qualify: warm-up run of {profile} at 3 clients" in done.stderr
    result = json.loads(done.stdout)
    chat_tokens = sum(Workload(requests=6, max_tokens=6, max_tokens_min=3).chat_max_tokens())  # 3..6 each
    assert [run["clients"] for run in result["runs"]] == [2, 3]
    order = [line.split(" at ")[0].removeprefix("qualify: ") for line in done.stderr.splitlines()
             if " clients (round " in line]  # fmt: skip
    assert order == ["baseline", "candidate", "share", "share", "candidate", "baseline"] * 2  # the order reverses
    for run in result["runs"]:
        assert len(run["rounds"]) == 2
        for profile in profiles:  # the gated figures summarize the rounds
            each = [Measurement(**r[profile]) for r in run["rounds"]]
            assert Measurement(**run[profile]) == median_measurement(each)
            assert all(m.requests_ok == 6 + 1 and m.output_tokens == chat_tokens + 3 for m in each)
        baseline, candidate, share = (Measurement(**run[p]) for p in profiles)
        for m in (baseline, candidate, share):
            assert m.requests_failed == 0 and m.requests_ok == 2 * (6 + 1)  # the chats and the long prompt, twice
            assert m.output_tokens == 2 * (chat_tokens + 3)
            assert m.output_tokens_per_s > 0 and m.median_decode_tokens_per_s > 0
            assert 0 < m.ttft_p50_s <= m.ttft_p95_s and m.long_ttft_p50_s is not None
            assert 0 < m.itl_p99_s <= m.worst_stall_s
        for name, m in (("candidate", candidate), ("share", share)):
            gates = {g["name"]: g["passed"] for g in run["gates"] if g["profile"] == name}
            assert gates == {g.name: g.passed for g in evaluate(baseline, m)}  # the printed verdicts
            assert set(gates) >= {"aggregate output tok/s", "median decode tok/s", "p95 TTFT s", "preemptions",
                                  "stalled steps"}  # fmt: skip
        front = pareto({p: Measurement(**run[p]) for p in profiles})
        assert run["pareto"] == {
            "front": list(front.front),
            "dominates": {k: list(v) for k, v in front.dominates.items()},
        }
    passing = [
        p for p in profiles[1:] if all(g["passed"] for r in result["runs"] for g in r["gates"] if g["profile"] == p)
    ]
    assert result["passing"] == passing and result["passed"] == (len(passing) == 2)
    assert (done.returncode == 0) == result["passed"]
    report = subprocess.run(  # a bad setting: exit 2 with what to change, before anything starts
        [sys.executable, "-m", "hybridserve_cli", "qualify", "--baseline-worker", "x", "--candidate-worker", "y",
         "--rounds", "0"], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert report.returncode == 2 and "--rounds must be >= 1" in report.stderr
    for name in ("ttft.png", "itl.png", "tokens_per_step.png", "pareto.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
