"""`hybridserve replay FILE [--step N]`: re-runs the planner offline on steps a worker recorded with
`--record-steps FILE`, and shows the plan, or how it differs from the recorded one.

Each JSONL record (the format: scheduler_svc/step_records.py) holds `step_index`, `request` (the
PlanStepRequest: base64 of its bytes, or its JSON form as google.protobuf.json_format writes it) and
`plan` (the recorded PlanStepResponse, in either form). The planner is deterministic, so an
unchanged config must reproduce the recorded plan byte for byte; `--config-override field=value`
replays under a changed config and shows the diff.

Exit status: 0 when every replayed plan equals the recorded one (or with --no-check), 1 when some
differ, 2 on a bad file or override.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf.message import Message

from hybridserve.errors import InvalidArgumentError
from hybridserve.v1 import scheduler_pb2 as pb
from scheduler_svc import convert
from scheduler_svc.core import MambaCacheMode, SchedulerConfig, StepPlan, plan_step
from scheduler_svc.step_records import read_steps


@dataclass(frozen=True, slots=True)
class Replayed:
    step_index: int
    recorded: pb.PlanStepResponse | None  # None when the record has no plan
    replayed: pb.PlanStepResponse
    # (request id, draft tokens verified, accepted) of the step's drafted rows, as the worker recorded them
    drafts: tuple[tuple[str, int, int], ...] = ()

    @property
    def is_identical(self) -> bool:
        return self.recorded is not None and _bytes(self.recorded) == _bytes(self.replayed)


def _bytes(msg: Message) -> bytes:
    return msg.SerializeToString(deterministic=True)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """["block_size=512", "mamba_cache_mode=none"] -> field values for SchedulerConfig."""
    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    overrides: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in fields:
            raise InvalidArgumentError(
                f"--config-override {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(fields))}"
            )
        if name == "mamba_cache_mode":
            try:
                overrides[name] = MambaCacheMode[raw.strip().upper()]
            except KeyError:
                raise InvalidArgumentError(f"--config-override {item!r}: use none or align") from None
        else:
            try:
                overrides[name] = int(raw)
            except ValueError:
                raise InvalidArgumentError(f"--config-override {item!r}: {raw!r} is not an integer") from None
    return overrides


def replay_one(request: pb.PlanStepRequest, overrides: dict[str, Any]) -> pb.PlanStepResponse:
    step = convert.step_from_pb(request)
    if overrides:
        step = dataclasses.replace(step, config=dataclasses.replace(step.config, **overrides).validate())
    return convert.plan_to_pb(plan_step(step))


def replay_file(path: Path, step: int | None = None, overrides: dict[str, Any] | None = None) -> list[Replayed]:
    results = []
    for recorded in read_steps(path):
        if step is None or recorded.step_index == step:
            replayed = replay_one(recorded.request, overrides or {})
            results.append(Replayed(recorded.step_index, recorded.plan, replayed, recorded.drafts()))
    if step is not None and not results:
        raise InvalidArgumentError(f"{path} has no record of step {step}")
    return results


def plan_table(step_index: int, msg: pb.PlanStepResponse) -> str:
    """A plan as text: a summary line, then one line per slice."""
    plan: StepPlan = convert.plan_from_pb(msg)
    s = plan.stats
    lines = [
        f"step {step_index}: quantum {plan.quantum}, decode {s.num_decode_tokens} + prefill {s.num_prefill_tokens}"
        f" tokens, prefill budget {s.prefill_budget_tokens}, pending prefills {s.num_pending_prefills},"
        f" stalled {'yes' if s.stalled else 'no'}, micro-sliced {'yes' if s.micro_sliced else 'no'},"
        f" KV pages {s.num_kv_pages_allocated}"
        + (f", draft tokens {s.num_draft_tokens}" if s.num_draft_tokens else ""),
        f"  preempted: {', '.join(plan.preempted_request_ids) or '-'}",
        f"  {'request_id':<24} {'kind':<8} {'tokens':>7}  checkpoint",
    ]
    for sl in plan.slices:
        kind = "prefill" if sl.is_prefill else "decode"
        lines.append(f"  {sl.request_id:<24} {kind:<8} {sl.num_tokens:>7}  {'yes' if sl.ends_on_checkpoint else 'no'}")
    return "\n".join(lines) + "\n"


def drafts_line(drafts: tuple[tuple[str, int, int], ...]) -> str:
    """What the step's verifications kept, as the worker recorded them ("" when it verified none)."""
    if not drafts:
        return ""
    drafted, accepted = sum(d for _, d, _ in drafts), sum(a for _, _, a in drafts)
    rows = ", ".join(f"{rid} {a}/{d}" for rid, d, a in drafts)
    return f"  drafts verified: {drafted} drafted, {accepted} accepted, {drafted - accepted} rejected ({rows})\n"


def render(result: Replayed, show_plan: bool) -> str:
    """The plan (show_plan) with the recorded verifications of its drafts, else one line when identical,
    else a unified diff of the plan tables."""
    replayed = plan_table(result.step_index, result.replayed)
    if result.recorded is None:
        return replayed + drafts_line(result.drafts)
    if result.is_identical:
        if show_plan:
            return replayed + drafts_line(result.drafts)
        return f"step {result.step_index}: identical ({len(result.replayed.slices)} slices)\n"
    recorded = plan_table(result.step_index, result.recorded)
    diff = difflib.unified_diff(
        recorded.splitlines(keepends=True),
        replayed.splitlines(keepends=True),
        fromfile=f"recorded step {result.step_index}",
        tofile=f"replayed step {result.step_index}",
    )
    return "".join(diff) or f"step {result.step_index}: same table, different bytes\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="JSONL written by `hybridserve worker --record-steps FILE`")
    parser.add_argument("--step", type=int, default=None, help="replay only this step index")
    parser.add_argument(
        "--config-override",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="replay under a changed SchedulerConfig field (repeatable), e.g. max_num_prefill_tokens_per_step=0",
    )
    parser.add_argument("--no-check", action="store_true", help="exit 0 even when plans differ")


def run(args: argparse.Namespace) -> int:
    try:
        results = replay_file(args.file, args.step, parse_overrides(args.config_override))
    except (InvalidArgumentError, OSError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    for result in results:
        sys.stdout.write(render(result, show_plan=args.step is not None))
    differing = [r.step_index for r in results if r.recorded is not None and not r.is_identical]
    print(f"{len(results)} steps replayed, {len(results) - len(differing)} identical, {len(differing)} differ")
    return 1 if differing and not args.no_check else 0
