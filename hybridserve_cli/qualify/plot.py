"""`qualify --plot DIR`: PNG charts of the profiles (matplotlib, the `plot` extra).

ttft.png          TTFT distribution (CDF) per profile and client count
itl.png           inter-token gap distribution (CDF, log x) of the chat requests
tokens_per_step.png  prefill and decode tokens per step over time (from the workers' step records)
pareto.png        each profile's aggregate tok/s against the chats' p99 inter-token gap and their
                  median decode tok/s, a panel a client count, the Pareto front marked
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridserve.v1 import scheduler_pb2
from hybridserve_cli.qualify.gates import Measurement, RequestTrace
from hybridserve_cli.qualify.pareto import pareto

Traces = dict[str, dict[int, list[RequestTrace]]]  # profile -> clients -> traces


def _cdf(ax: object, values: Sequence[float], label: str) -> None:
    ordered = sorted(values)
    if ordered:
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)  # type: ignore[attr-defined]


def _ttfts(run: list[RequestTrace]) -> list[float]:
    return [v for x in run if x.ok and (v := x.ttft_s) is not None]


def _chat_gaps(run: list[RequestTrace]) -> list[float]:
    return [g for x in run if x.ok and x.kind == "chat" for g in x.gaps_s]


def step_series(path: Path) -> tuple[list[float], list[int], list[int]]:
    """(start time of each recorded step from the first, prefill tokens, decode tokens)."""
    times: list[float] = []
    prefill: list[int] = []
    decode: list[int] = []
    if not path.exists():
        return times, prefill, decode
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("plan") is None:
            continue
        plan = scheduler_pb2.PlanStepResponse.FromString(base64.b64decode(record["plan"]))
        times.append(float(record["time_unix_s"]) - float(record.get("wall_s", 0.0)))
        prefill.append(sum(s.num_tokens for s in plan.slices if s.is_prefill))
        decode.append(sum(s.num_tokens for s in plan.slices if not s.is_prefill))
    origin = times[0] if times else 0.0
    return [t - origin for t in times], prefill, decode


def write_plots(
    folder: Path, traces: Traces, records: Path, measured: dict[int, dict[str, Measurement]] | None = None
) -> list[Path]:
    """Writes the charts; returns their paths. `records` holds PROFILE-steps.jsonl when recorded;
    `measured` (clients -> profile -> the medians) draws pareto.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, pick, xlabel, log in (
        ("ttft.png", _ttfts, "TTFT (s)", False),
        ("itl.png", _chat_gaps, "inter-token gap (s)", True),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        for profile, by_clients in traces.items():
            for clients, run in by_clients.items():
                _cdf(ax, pick(run), f"{profile}, {clients} clients")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests" if name == "ttft.png" else "fraction of gaps")
        if log:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        written.append(folder / name)
    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 2.6 * len(traces)), sharex=True, squeeze=False)
    for ax, profile in zip(axes[:, 0], traces, strict=True):
        t, prefill, decode = step_series(records / f"{profile}-steps.jsonl")
        ax.plot(t, prefill, ".", markersize=2, label="prefill tokens")
        ax.plot(t, decode, ".", markersize=2, label="decode tokens")
        ax.set_title(profile)
        ax.set_ylabel("tokens per step")
        ax.legend(loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(folder / "tokens_per_step.png", dpi=110)
    plt.close(fig)
    written.append(folder / "tokens_per_step.png")
    if measured:
        written.append(_pareto_plot(plt, folder, measured))
    for profile in traces:
        if (records / f"{profile}-steps.jsonl").exists():
            written.append(Path(shutil.copy(records / f"{profile}-steps.jsonl", folder / f"{profile}-steps.jsonl")))
    return written


def _itl_p99(m: Measurement) -> float:
    return m.itl_p99_s


def _median_decode(m: Measurement) -> float:
    return m.median_decode_tokens_per_s


def _pareto_plot(plt: Any, folder: Path, measured: dict[int, dict[str, Measurement]]) -> Path:
    fig, axes = plt.subplots(2, len(measured), figsize=(4.5 * len(measured), 7), squeeze=False)
    for col, (clients, by_profile) in enumerate(sorted(measured.items())):
        front = set(pareto(by_profile).front)
        for row, (label, get) in enumerate((
            ("chat ITL p99 (s)", _itl_p99),
            ("median decode tok/s", _median_decode),
        )):  # fmt: skip
            ax = axes[row, col]
            for name, m in by_profile.items():
                ax.plot(m.output_tokens_per_s, get(m), "o" if name in front else "x")
                ax.annotate(name, (m.output_tokens_per_s, get(m)), fontsize=8)
            ax.set_xlabel("aggregate output tok/s")
            ax.set_ylabel(label)
            ax.set_title(f"{clients} clients (o: Pareto front)")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    path = folder / "pareto.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
