"""Profiles side by side on the four figures a scheduling policy trades against each other, pure:
aggregate output tokens/s and the chats' median decode tokens/s (higher is better), the chats' p99
inter-token gap and the long prompts' median TTFT (lower is better; the latter only where long prompts
ran). A profile dominates another when it is at least as good on every figure and better on one; the
Pareto front is the profiles no other dominates. One table a client count (`qualify`'s report)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hybridserve_cli.qualify.gates import Measurement

# (column, the figure, +1: higher is better / -1: lower is better)
Objective = tuple[str, Callable[[Measurement], float | None], int]
OBJECTIVES: tuple[Objective, ...] = (
    ("aggregate tok/s", lambda m: m.output_tokens_per_s, +1),
    ("median decode tok/s", lambda m: m.median_decode_tokens_per_s, +1),
    ("chat ITL p99 s", lambda m: m.itl_p99_s, -1),
    ("long TTFT p50 s", lambda m: m.long_ttft_p50_s, -1),
)


@dataclass(frozen=True, slots=True)
class Pareto:
    front: tuple[str, ...]  # the profiles no other dominates, in the given order
    dominates: dict[str, tuple[str, ...]]  # profile -> the profiles it dominates


def _figures(measured: Mapping[str, Measurement]) -> list[Objective]:
    """The objectives every profile has a figure for (the long prompts' TTFT only with long prompts)."""
    return [o for o in OBJECTIVES if all(o[1](m) is not None for m in measured.values())]


def dominates(a: Measurement, b: Measurement, figures: list[Objective]) -> bool:
    better = False
    for _, get, sign in figures:
        x, y = get(a), get(b)
        assert x is not None and y is not None
        if sign * x < sign * y:
            return False
        better = better or sign * x > sign * y
    return better


def pareto(measured: Mapping[str, Measurement]) -> Pareto:
    figures = _figures(measured)
    beats = {
        name: tuple(other for other, m in measured.items() if other != name and dominates(mine, m, figures))
        for name, mine in measured.items()
    }
    front = tuple(name for name in measured if not any(name in beaten for beaten in beats.values()))
    return Pareto(front=front, dominates=beats)


def pareto_table(measured: Mapping[str, Measurement]) -> str:
    """One row a profile: its four figures and who dominates it; then the front and the dominance."""
    figures = _figures(measured)
    result = pareto(measured)
    clients = next(iter(measured.values())).clients
    header = f"{'profile':<16}" + "".join(f"{name:>21}" for name, _, _ in figures) + "  dominated by"
    lines = [f"Pareto, {clients} clients:", header]
    for name, m in measured.items():
        by = [other for other, beaten in result.dominates.items() if name in beaten]
        lines.append(f"{name:<16}" + "".join(f"{get(m):>21.3f}" for _, get, _ in figures) + f"  {', '.join(by) or '-'}")
    lines.append(f"front: {', '.join(result.front)}")
    for name, beaten in result.dominates.items():
        if beaten:
            lines.append(f"{name} dominates {', '.join(beaten)}")
    return "\n".join(lines)
