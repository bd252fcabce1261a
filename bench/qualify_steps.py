"""What each profile's steps cost, from the step records `hybridserve qualify --plot DIR` leaves in DIR
(PROFILE-steps.jsonl: every step of every run, the warm-ups included, read with
scheduler_svc/step_records.py):

    decode-only steps    how many, their wall time p50
    mixed steps          how many (decodes and prefill together), their wall time p50 / p99 / max:
                         the steps a chat's inter-token gap waits on
    prefill per mixed    tokens p50 / max: how much prefill a profile lets into a step with decodes
    ms / prefill token   a mixed step's wall time over a decode-only step's p50, per prefill token
                         (mixed steps of 64 prefill tokens or more): small chunks pay the forward's
                         fixed costs (the weights read, per-op dispatch) over fewer tokens

    .venv/bin/python bench/qualify_steps.py DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler_svc.step_records import read_steps  # noqa: E402


def _ms(values: list[float], q: float | None = None) -> str:
    if not values:
        return "-"
    if q is None:
        return f"{statistics.median(values) * 1e3:.1f}"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3:.1f}"


def profile_line(path: Path) -> str:
    decode_only: list[float] = []
    mixed: list[tuple[float, int]] = []
    for step in read_steps(path):
        if step.plan is None or step.wall_s is None:
            continue
        prefill = sum(s.num_tokens for s in step.plan.slices if s.is_prefill)
        decode = sum(s.num_tokens for s in step.plan.slices if not s.is_prefill)
        if decode and not prefill:
            decode_only.append(step.wall_s)
        elif decode and prefill:
            mixed.append((step.wall_s, prefill))
    base = statistics.median(decode_only) if decode_only else 0.0
    per_token = [(w - base) / p * 1e3 for w, p in mixed if p >= 64]
    walls = [w for w, _ in mixed]
    tokens = [p for _, p in mixed]
    return (
        f"{path.name.removesuffix('-steps.jsonl'):<12} "
        f"decode-only {len(decode_only):5d} p50 {_ms(decode_only):>6} ms | "
        f"mixed {len(mixed):5d} p50 {_ms(walls):>6} p99 {_ms(walls, 0.99):>7} max {_ms(walls, 1.0):>7} ms | "
        f"prefill/mixed p50 {statistics.median(tokens) if tokens else 0:5.0f} max {max(tokens, default=0):5d} | "
        f"ms/prefill token {statistics.median(per_token) if per_token else 0:.3f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="folders `qualify --plot` wrote")
    args = parser.parse_args()
    for folder in args.folders:
        print(f"== {folder}")
        for path in sorted(folder.glob("*-steps.jsonl")):
            print(profile_line(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
