"""`hybridserve qualify --baseline=FLAGS --candidate=FLAGS [--profile NAME=FLAGS ...]`: scheduler
profiles compared with a baseline by the qualification gates (docs/design.md, How quality is
judged), and with each other on a Pareto table, as a command.

Starts one scheduler and a worker per profile on the same model (worker flags: `--common` then the
profile's own), or uses two running workers (`--baseline-worker`, `--candidate-worker`); drives the
same seeded workload (hybridserve_cli.qualify.workload) at each client count, the profiles in turn
(the order reverses round by round), `--rounds` times (the gates read each profile's medians over its
rounds; a line a client count shows every round's ratios); reads each worker's preemption and stall
counters around every run; prints each profile's gates against the baseline
(hybridserve_cli.qualify.gates) and the Pareto table of the profiles (hybridserve_cli.qualify.pareto),
or `--json`; `--plot DIR` writes PNG charts (matplotlib, an optional extra). Exit 0 when every gate of
every profile passes, 1 when one fails, 2 when the runs could not be made.

    hybridserve qualify --baseline="--max-num-prefill-tokens-per-step 0" \\
        --candidate="--max-num-prefill-tokens-per-step 512" --workload convoy \\
        --profile share="--prefill-share-mode auto"
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from gpu_worker.api.client import describe_rpc_error, generation_stub
from hybridserve.children import ChildExited
from hybridserve.settings import Flag, add_settings_arguments, settings_from_args
from hybridserve.v1 import generation_pb2
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
from hybridserve_cli.qualify.pareto import pareto, pareto_table
from hybridserve_cli.qualify.workload import Workload, run_workload
from hybridserve_cli.stack import Stack

START_TIMEOUT_S = 300.0
BASELINE = "baseline"


@dataclass(frozen=True, slots=True)
class QualifySettings:
    baseline: str = ""  # worker flags of the baseline profile (one string)
    candidate: str = ""  # worker flags of the candidate profile ("" with --profile: none by that name)
    common: str = "--no-prefix-caching"  # worker flags both profiles get, before their own
    model: Path | None = None  # checkpoint folder; None = a random model of the benchmark size (written once)
    baseline_worker: str = ""  # host:port of a running baseline worker (then nothing is started)
    candidate_worker: str = ""
    clients: str = "16,32"  # client counts, comma-separated
    workload: str = "chat"  # chat | convoy
    requests: int = 64  # chat requests per run
    prompt_len_min: int = 16
    prompt_len_max: int = 256
    max_tokens: int = 64
    max_tokens_min: int = 0  # > 0: each chat's new tokens seeded uniform in [max_tokens_min, max_tokens]
    long_prompts: int = 4  # convoy only
    long_prompt_len: int = 6000
    long_max_tokens: int = 16
    long_after_s: float = 1.0
    long_interval_s: float = 0.5
    seed: int = 0
    warmup_requests: int = 8  # per worker before the measured runs
    warmup_runs: int = 1  # untimed runs of the whole workload per profile (most clients) before measuring
    rounds: int = 3  # measured runs per profile and client count, who goes first alternating; medians gated
    max_throughput_loss: float = 0.03
    max_decode_loss: float = 0.0
    max_ttft_p95_increase: float = 0.05
    json: bool = False
    plot: Path | None = None  # folder for PNG charts
    profiles: tuple[tuple[str, str], ...] = ()  # more candidates: (name, worker flags), from --profile NAME=FLAGS

    def __post_init__(self) -> None:
        if self.workload not in ("chat", "convoy"):
            raise ValueError(f"--workload must be chat or convoy, got {self.workload!r}")
        if bool(self.baseline_worker) != bool(self.candidate_worker):
            raise ValueError("give both --baseline-worker and --candidate-worker, or neither")
        if self.baseline_worker and self.profiles:
            raise ValueError("--profile starts a worker of its own: not with --baseline-worker/--candidate-worker")
        names = [name for name, _ in self.candidates]
        if len(set(names)) != len(names) or BASELINE in names or not all(n.replace("-", "").isalnum() for n in names):
            raise ValueError(f"profile names must be distinct words other than {BASELINE!r}, got {names}")
        if self.warmup_runs < 0:
            raise ValueError(f"--warmup-runs must be >= 0, got {self.warmup_runs}")
        if not 0 <= self.max_tokens_min <= self.max_tokens:
            raise ValueError(
                f"--max-tokens-min must be 0 (every chat asks for --max-tokens) or 1..{self.max_tokens}, "
                f"got {self.max_tokens_min}"
            )
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
        if not self.client_counts or min(self.client_counts) < 1:
            raise ValueError(f"--clients needs positive counts, got {self.clients!r}")

    @property
    def candidates(self) -> tuple[tuple[str, str], ...]:
        """(name, worker flags) of every profile compared with the baseline, in order: "candidate"
        (--candidate, which may be empty: the baseline against itself), unless only --profile ones
        were given."""
        given = (("candidate", self.candidate),) if self.candidate or self.candidate_worker or not self.profiles else ()
        return given + self.profiles

    @property
    def profile_names(self) -> tuple[str, ...]:
        return (BASELINE, *(name for name, _ in self.candidates))

    def flags_of(self, profile: str) -> str:
        return self.baseline if profile == BASELINE else dict(self.candidates)[profile]

    @property
    def client_counts(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.clients.split(",") if x.strip())

    def workload_spec(self) -> Workload:
        return Workload(
            kind=self.workload, requests=self.requests, prompt_len_min=self.prompt_len_min,
            prompt_len_max=self.prompt_len_max, max_tokens=self.max_tokens, max_tokens_min=self.max_tokens_min,
            long_prompts=self.long_prompts, long_prompt_len=self.long_prompt_len, long_max_tokens=self.long_max_tokens,
            long_after_s=self.long_after_s, long_interval_s=self.long_interval_s, seed=self.seed,
        )  # fmt: skip

    def tolerances(self) -> Tolerances:
        return Tolerances(self.max_throughput_loss, self.max_decode_loss, self.max_ttft_p95_increase)


FLAGS = {
    "baseline": Flag("worker flags of the baseline profile, one string: --baseline='--max-num-seqs 16'"),
    "candidate": Flag("worker flags of the candidate profile, one string"),
    "common": Flag("worker flags both profiles get"),
    "model": Flag("checkpoint folder (default: a random model of the benchmark size)", metavar="DIR"),
    "baseline_worker": Flag("use this running worker as the baseline (host:port)"),
    "candidate_worker": Flag("use this running worker as the candidate (host:port)"),
    "workload": Flag("chat (closed-loop chats) | convoy (chats + long prompts arriving mid-run)"),
    "warmup_runs": Flag("untimed runs of the whole workload on each profile before the measured ones"),
    "max_tokens_min": Flag(
        "0: every chat asks for --max-tokens; else each chat's count seeded uniform from this to --max-tokens"
        " (chats of one length finish together, so a closed loop sends the next prompts in waves)"
    ),
    "rounds": Flag(
        "measured runs of each profile per client count, who goes first alternating; the gates "
        "read the medians (a noisy machine moves one run's figures by more than a 3%% gate)"
    ),
    "json": Flag("print the measurements and gates as JSON", switch=True),
    "plot": Flag("write PNG charts to this folder (needs matplotlib)", metavar="DIR"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, QualifySettings, "QUALIFY", flags=FLAGS, exclude=("profiles",))
    parser.add_argument("--profile", action="append", default=[], metavar="NAME=FLAGS",
                        help="one more profile to compare with the baseline (repeatable): --profile share='--prefill-"
                        "share-mode auto'")  # fmt: skip


def parse_profiles(items: list[str]) -> tuple[tuple[str, str], ...]:
    """--profile NAME=FLAGS values as (name, flags)."""
    parsed = []
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--profile wants NAME=FLAGS, got {item!r}")
        parsed.append((name.strip(), flags))
    return tuple(parsed)


def default_model(folder: Path) -> Path:
    """A random Bamba of the benchmark size (hidden 256, 8 layers, attention at 3 and 7, vocab 512)."""
    from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint

    model = folder / "qualify-model"
    spec = ModelSpec(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                     attn_layer_indices=(3, 7), num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8,
                     mamba_d_state=64, mamba_chunk_size=256, init_std=0.06)  # fmt: skip
    if not (model / "config.json").exists():
        write_random_checkpoint(model, spec, seed=0, with_tokenizer=False)
    return model


def worker_info(address: str) -> generation_pb2.GetInfoResponse:
    with grpc.insecure_channel(address) as channel:
        info: generation_pb2.GetInfoResponse = generation_stub(channel).GetInfo(
            generation_pb2.GetInfoRequest(), timeout=30
        )
        return info


def start_stack(s: QualifySettings, folder: Path, stack: Stack) -> dict[str, str]:
    """One scheduler and a worker per profile; returns each profile's worker address."""
    model = s.model or default_model(folder)
    scheduler = stack.scheduler()
    for profile in s.profile_names:
        flags = shlex.split(s.common) + shlex.split(s.flags_of(profile))
        if s.plot is not None:
            flags += ["--record-steps", str(folder / f"{profile}-steps.jsonl")]
        stack.worker(model, [scheduler], flags=flags, name=f"{profile}-worker", wait=False)  # all load at once
    return {profile: stack.wait_listening(f"{profile}-worker") for profile in s.profile_names}


def counters(address: str) -> tuple[int, int]:
    info = worker_info(address)
    return int(info.num_preemptions), int(info.num_stalled_steps)


def run_profile(address: str, workload: Workload, clients: int, vocab: int) -> tuple[Measurement, list[RequestTrace]]:
    before = counters(address)
    traces, wall_s = run_workload(address, workload, clients, vocab)
    after = counters(address)
    return measure(traces, clients, wall_s, after[0] - before[0], after[1] - before[1]), traces


def qualify(s: QualifySettings, addresses: dict[str, str]) -> dict[str, object]:
    """Warms every worker up, then runs the workload at each client count on every profile."""
    profiles = s.profile_names
    vocab = int(worker_info(addresses[BASELINE]).vocab_size)
    workload = s.workload_spec()
    warmup = Workload(requests=s.warmup_requests, prompt_len_min=s.prompt_len_min, prompt_len_max=s.prompt_len_max,
                      max_tokens=min(8, s.max_tokens), seed=s.seed + 1)  # fmt: skip
    for profile in profiles:
        run_workload(addresses[profile], warmup, min(4, s.warmup_requests) or 1, vocab)
    # The measured workload once per profile, untimed: a worker's first steps of each size pay for
    # kernels built on first use (and a fresh worker warms kernels up in the background), which
    # otherwise lands on whichever profile is measured first. Other prompts (a seed of their own), so
    # that a prefix cache, if on, holds none of the measured ones.
    for _ in range(s.warmup_runs):
        for profile in profiles:
            print(
                f"qualify: warm-up run of {profile} at {max(s.client_counts)} clients ...", file=sys.stderr, flush=True
            )
            run_workload(addresses[profile], replace(workload, seed=s.seed + 2), max(s.client_counts), vocab)
    runs: list[dict[str, object]] = []
    traces: dict[str, dict[int, list[RequestTrace]]] = {p: {} for p in profiles}
    turn = 0
    for clients in s.client_counts:
        rounds: list[dict[str, Measurement]] = []
        for r in range(s.rounds):
            order = profiles if turn % 2 == 0 else profiles[::-1]  # who goes first, and last, alternates
            turn += 1
            measured: dict[str, Measurement] = {}
            for profile in order:
                of = f" (round {r + 1} of {s.rounds})" if s.rounds > 1 else ""
                print(f"qualify: {profile} at {clients} clients{of} ...", file=sys.stderr, flush=True)
                measured[profile], got = run_profile(addresses[profile], workload, clients, vocab)
                traces[profile].setdefault(clients, []).extend(got)
            rounds.append(measured)
        summary = {p: median_measurement([m[p] for m in rounds]) for p in profiles}
        gates = [{"profile": name, **asdict(g)} for name, _ in s.candidates
                 for g in evaluate(summary[BASELINE], summary[name], s.tolerances())]  # fmt: skip
        front = pareto(summary)
        dominance = {k: list(v) for k, v in front.dominates.items()}
        run: dict[str, object] = {"clients": clients, **{p: asdict(summary[p]) for p in profiles}, "gates": gates,
                                  "pareto": {"front": list(front.front), "dominates": dominance}}  # fmt: skip
        if s.rounds > 1:
            run["rounds"] = [{p: asdict(m[p]) for p in profiles} for m in rounds]
        runs.append(run)
    passing = [name for name, _ in s.candidates if all(g["passed"] for g in gates_of(runs, name))]
    return {"workload": asdict(workload), "baseline": s.baseline, "candidate": s.candidate, "common": s.common,
            "profiles": {name: flags for name, flags in s.candidates}, "runs": runs, "passing": passing,
            "passed": len(passing) == len(s.candidates), "_traces": traces}  # fmt: skip


def gates_of(runs: list[dict[str, object]], profile: str) -> list[dict[str, object]]:
    """One profile's gates over every client count of `qualify`'s runs."""
    return [g for run in runs for g in run["gates"] if g["profile"] == profile]  # type: ignore[attr-defined]


def _pair(run: dict[str, object], profile: str) -> tuple[Measurement, Measurement]:
    """(baseline, profile) of one run or round of `qualify`'s result."""
    return Measurement(**run[BASELINE]), Measurement(**run[profile])  # type: ignore[arg-type]


def report_text(s: QualifySettings, result: dict[str, object]) -> str:
    """Each profile's gates against the baseline and, with several rounds, each round's ratios; then
    the Pareto table of every client count and which profiles pass."""
    runs: list[dict[str, object]] = result["runs"]  # type: ignore[assignment]
    lines = [f"workload {s.workload}: baseline [{s.baseline}] (every profile: [{s.common}])"]
    if s.rounds > 1:
        lines.append(f"{s.rounds} rounds a client count, who goes first alternating; figures: each profile's median")
    for name, flags in s.candidates:
        lines += ["", f"{name} [{flags}] vs baseline:", format_report([_pair(r, name) for r in runs], s.tolerances())]
        for r in runs:
            if "rounds" in r:
                each = [_pair(x, name) for x in r["rounds"]]  # type: ignore[attr-defined]
                lines.append(f"rounds at {r['clients']} clients, {name} / baseline: {round_ratios(each)}")
    for r in runs:
        lines += ["", pareto_table({p: Measurement(**r[p]) for p in s.profile_names})]  # type: ignore[arg-type]
    passing: list[str] = result["passing"]  # type: ignore[assignment]
    lines += ["", f"profiles that pass every gate against the baseline: {', '.join(passing) or 'none'}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        s = settings_from_args(QualifySettings, args, profiles=parse_profiles(args.profile))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stack = Stack(start_timeout_s=START_TIMEOUT_S, die_with_parent=False)  # this process runs gRPC
    # SIGTERM ends the run like Ctrl-C: through `finally`, which stops the workers (they get no death
    # signal of their own, as this process runs gRPC)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    addresses: dict[str, str] = {BASELINE: s.baseline_worker, "candidate": s.candidate_worker}
    with tempfile.TemporaryDirectory(prefix="hybridserve-qualify-") as tmp:
        try:
            if not s.baseline_worker:
                addresses = start_stack(s, Path(tmp), stack)
            result = qualify(s, addresses)
        except (ChildExited, TimeoutError) as exc:
            print(f"error: could not start the stack: {exc}", file=sys.stderr)
            return 2
        except grpc.RpcError as exc:
            print(f"error: {describe_rpc_error(exc, ' / '.join(addresses.values()))}", file=sys.stderr)
            return 2
        finally:
            stack.stop()
        traces = result.pop("_traces")
        if s.plot is not None:
            from hybridserve_cli.qualify.plot import write_plots

            runs: list[dict[str, Any]] = result["runs"]  # type: ignore[assignment]
            measured = {r["clients"]: {p: Measurement(**r[p]) for p in s.profile_names} for r in runs}
            for path in write_plots(s.plot, traces, Path(tmp), measured):  # type: ignore[arg-type]
                print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(result, indent=2) if s.json else report_text(s, result))
    return 0 if result["passed"] else 1
