"""The timeline's pure view model and its writers, on hand-made step records: lanes (queued,
prefill chunks with checkpoints, decode, idle, preemption, finish), the skipped slices of
asynchronous scheduling, both axes, the Perfetto events, the page's self-containment."""

from __future__ import annotations

import json
import re

import pytest

from hybridserve_cli.timeline.page import render_page, view_json
from hybridserve_cli.timeline.perfetto import trace_events
from hybridserve_cli.timeline.records import RequestEvent, StepRecord
from hybridserve_cli.timeline.view import Clock, build_timeline, grid_boundaries, step_intervals
from scheduler_svc.core import PlanStats, RequestState, Slice, StepInput, StepPlan
from tests.scheduler.helpers import config

CFG = config(max_num_batched_tokens=64, max_num_prefill_tokens_per_step=32, block_size=16, mamba_block_size=8)
T0 = 1_000.0


def state(rid: str, prompt: int, computed: int, outputs: int = 0) -> RequestState:
    return RequestState(rid, prompt, computed, outputs, 8, 0, 0.0)


def queued(rid: str, at: float, prompt: int = 40, trace: str = "") -> RequestEvent:
    return RequestEvent("queued", rid, trace, T0 + at, None, None, "", prompt, 0, 0)


def finished(rid: str, at: float, first: float, reason: str = "length", outputs: int = 3) -> RequestEvent:
    return RequestEvent("finished", rid, "", None, T0 + first, T0 + at, reason, 0, outputs, 0)


def rec(k: int, running=(), waiting=(), slices=(), preempted=(), events=(), wall: float | None = 0.1, **stats):
    """Step k ran over [T0 + k/10 + 0.05 - wall, T0 + k/10 + 0.05] (0.1 s steps back to back)."""
    plan_stats = PlanStats(
        num_decode_tokens=sum(n for _, n, p, _ in slices if not p),
        num_prefill_tokens=sum(n for _, n, p, _ in slices if p),
        prefill_budget_tokens=32, num_pending_prefills=0, stalled=stats.get("stalled", False),
        micro_sliced=stats.get("micro_sliced", False), num_kv_pages_allocated=0,
    )  # fmt: skip
    plan = StepPlan(tuple(Slice(*s) for s in slices), tuple(preempted), 16, plan_stats)
    return StepRecord(
        step_index=k, step_input=StepInput(CFG, tuple(running), tuple(waiting), k, 10), plan=plan,
        end_unix_s=T0 + k / 10 + 0.05 + 0.1, wall_s=wall, plan_latency_s=0.001, trace_id=f"{k:032x}",
        events=tuple(events), plan_text=f"step {k}: the plan\n", reproduces=True,
    )  # fmt: skip


def story() -> list[StepRecord]:
    """a: 40-token prompt in chunks 32 + 8, decodes, finishes in step 3 (async: step 4 still plans
    a decode for it, and a preemption). b: waits, runs a chunk, is preempted, recomputes."""
    return [
        rec(0, waiting=[state("a", 40, 0), state("b", 20, 0)], slices=[("a", 32, True, True)],
            events=[queued("a", 0.0, 40, trace="ab" * 16), queued("b", 0.01, 20)]),
        rec(1, running=[state("a", 40, 32)], waiting=[state("b", 20, 0)],
            slices=[("a", 8, True, False), ("b", 16, True, True)], micro_sliced=True),
        rec(2, running=[state("a", 40, 40, 1), state("b", 20, 16)], slices=[("a", 1, False, False)],
            stalled=True),
        rec(3, running=[state("a", 40, 41, 2), state("b", 20, 16)], slices=[("a", 1, False, False)],
            preempted=["b"], events=[finished("a", 0.38, first=0.24)]),
        rec(4, running=[state("a", 40, 42, 3)], waiting=[state("b", 20, 0)],
            slices=[("a", 1, False, False), ("b", 20, True, False)], preempted=["a"]),
    ]  # fmt: skip


def test_lanes_follow_each_request_through_queue_chunks_decode_preemption_and_finish():
    timeline = build_timeline(story())
    a, b = timeline.lanes
    assert (a.request_id, a.trace_id, a.prompt_tokens) == ("a", "ab" * 16, 40)
    assert (a.finish_reason, a.completion_tokens) == ("length", 3)
    kinds = [(s.kind, s.step_index, s.token_start, s.token_end, s.ends_on_checkpoint) for s in a.segments]
    assert kinds == [
        ("queued", -1, 0, 0, False),
        ("prefill", 0, 0, 32, True),
        ("prefill", 1, 32, 40, False),
        ("decode", 2, 40, 41, False),
        ("decode", 3, 41, 42, False),
    ]  # step 4's decode for a is skipped: a finished in step 3
    assert [m.kind for m in a.marks] == ["first_token", "finished"] and a.marks[-1].label == "length"
    assert [(s.kind, s.step_index, s.token_start, s.token_end) for s in b.segments] == [
        ("queued", -1, 0, 0),
        ("prefill", 1, 0, 16),
        ("idle", -1, 0, 0),  # running in step 2 with no tokens
        ("queued", -1, 0, 0),  # preempted in step 3, back in the queue
        ("prefill", 4, 0, 20),  # the recompute starts over
    ]
    # no finish event: the first token is where the prompt's last chunk ran
    assert [(m.kind, m.label, m.pos) for m in b.marks] == [("preempted", "3", 3.0), ("first_token", "", 5.0)]
    assert b.finish_reason == "" and b.completion_tokens == -1
    steps = timeline.steps
    assert [s.num_skipped_slices for s in steps] == [0, 0, 0, 0, 1]
    assert steps[4].preempted_request_ids == () and steps[3].preempted_request_ids == ("b",)
    assert steps[4].skipped_request_ids == ("a",) and steps[3].skipped_request_ids == ()
    assert (steps[1].num_prefill_tokens, steps[2].num_decode_tokens) == (24, 1)
    assert steps[1].micro_sliced and steps[2].stalled and steps[0].trace_id == f"{0:032x}"


def test_a_request_aborted_while_queued_and_one_still_queued_at_the_end_keep_their_queue_stretch():
    aborted = RequestEvent("finished", "c", "", None, None, T0 + 0.2, "abort", 0, 0, 0)
    records = [
        rec(0, waiting=[state("c", 30, 0)], events=[queued("c", 0.06, 30)]),
        rec(1, waiting=[state("c", 30, 0), state("d", 30, 0)], events=[aborted]),
    ]
    c, d = build_timeline(records).lanes
    assert [(g.kind, g.start_pos, g.end_pos) for g in c.segments] == [
        ("queued", pytest.approx(0.1), pytest.approx(1.5))
    ]
    assert [(m.kind, m.label) for m in c.marks] == [("finished", "abort")] and c.finish_reason == "abort"
    assert [(g.kind, g.start_pos, g.end_pos) for g in d.segments] == [("queued", 1.0, 2.0)]
    assert d.marks == () and d.finish_reason == ""


def test_both_axes_place_marks_inside_the_step_that_holds_them():
    timeline = build_timeline(story())
    assert timeline.origin_unix_s == T0  # a arrived before step 0 started (at T0 + 0.05)
    assert timeline.lanes[0].segments[0].start_s == 0.0 and timeline.lanes[0].segments[0].start_pos == 0.0
    first, finish = timeline.lanes[0].marks
    assert first.t_s == pytest.approx(0.24) and first.pos == pytest.approx(1.9)  # step 1: [0.15, 0.25)
    assert finish.t_s == pytest.approx(0.38) and finish.pos == pytest.approx(3.3)  # step 3: [0.35, 0.45)
    for k, s in enumerate(timeline.steps):
        assert s.position == k and s.start_s == pytest.approx(k / 10 + 0.05) and s.end_s == pytest.approx(k / 10 + 0.15)


def test_step_intervals_never_overlap_and_old_records_start_where_the_previous_ended():
    records = [rec(0, wall=None), rec(1, wall=None), rec(2, wall=0.5)]  # step 2 claims to start too early
    (s0, e0), (s1, e1), (s2, e2) = step_intervals(records)
    assert s0 == pytest.approx(e0 - 0.001)  # no wall time and nothing before: the plan latency
    assert s1 == e0 and s2 == e1 and e0 < e1 < e2
    clock = Clock([(0.0, 1.0), (2.0, 3.0)], 0.0)
    assert [clock.position(t) for t in (-1.0, 0.5, 1.5, 2.25, 9.0)] == [0.0, 0.5, 1.0, 1.25, 2.0]
    assert grid_boundaries(0, 32, 16) == 2 and grid_boundaries(20, 31, 16) == 0 and grid_boundaries(8, 16, 16) == 1


def test_perfetto_has_one_event_per_slice_and_consistent_durations():
    records = story()
    timeline = build_timeline(records)
    events = trace_events(timeline)["traceEvents"]
    for e in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= e.keys() and e["ph"] in ("X", "i", "M")
        assert e["ph"] != "X" or e["dur"] >= 0
    slices = [e for e in events if e.get("cat") in ("prefill", "decode")]
    expected = [(lane.request_id, s.step_index) for lane in timeline.lanes for s in lane.segments if s.step_index >= 0]
    assert sorted((e["args"]["request_id"], e["args"]["step_index"]) for e in slices) == sorted(expected)
    assert len(expected) == sum(len(r.plan.slices) for r in records) - 1 == 6  # less the skipped one
    steps = {e["args"]["step_index"]: e for e in events if e.get("cat") == "step"}
    assert list(steps) == [0, 1, 2, 3, 4] and {e["tid"] for e in steps.values()} == {0}
    ordered = list(steps.values())
    for before, after in zip(ordered, ordered[1:], strict=False):
        assert before["ts"] + before["dur"] <= after["ts"] + 1e-3
    for e in slices:  # a slice lies within its step
        step = steps[e["args"]["step_index"]]
        assert step["ts"] - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e-3
    tids = {e["tid"] for e in events if e["pid"] == 2 and e["ph"] != "M"}
    assert len(tids) == len(timeline.lanes) == 2
    assert [e["name"] for e in events if e["ph"] == "i"] == ["finished: length", "preempted"]


def test_page_is_self_contained_and_links_traces_only_with_a_jaeger_url():
    records = story()
    records[0] = rec(0, waiting=[state("</script><b>x", 40, 0)], events=[queued("</script><b>x", 0.0, trace="cd" * 16)])
    timeline = build_timeline(records)
    page = render_page(timeline, "steps.jsonl")
    assert not re.search(r"https?:|//[a-z]|\bsrc=|<link|@import|url\(", page, re.I), "a network reference"
    assert page.count("</script>") == 2 and "<\\/script><b>x" in page
    data = re.search(r'<script id="timeline-data" type="application/json">(.*?)</script>', page, re.S)
    assert data is not None and json.loads(data.group(1)) == json.loads(json.dumps(view_json(timeline, "steps.jsonl")))
    linked = render_page(timeline, "steps.jsonl", "http://jaeger.example:16686/")
    assert re.findall(r"https?://[^\"']*", linked) == ["http://jaeger.example:16686"]
