"""What the step recorder writes for the timeline (wall time, trace ids, request events) on a
traced in-process stack, that `replay` still reads those files, and the command's errors."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import hybridserve_cli as cli
from gpu_worker.engine.records import FirstToken, RequestFinished, RequestQueued
from gpu_worker.engine.request import FinishReason
from gpu_worker.observers.recording import StepRecorder
from hybridserve_cli.timeline.records import load_records
from hybridserve_cli.timeline.view import build_timeline
from scheduler_svc.core import plan_step
from scheduler_svc.replay import replay_file
from tests.observability.conftest import greedy, prompt_of
from tests.scheduler.helpers import seed_step


def test_traced_run_records_step_and_request_trace_ids_and_events(start_stack, tmp_path, capsys):
    record = tmp_path / "steps.jsonl"
    stack = start_stack(record=record, traced=True)
    prompts = [prompt_of(30 + 17 * i, i) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda p: list(stack.stub.Generate(greedy(p, 5), timeout=60)), prompts))
    stack.stop()
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    spans = stack.exporter.get_finished_spans()
    step_traces = [format(s.context.trace_id, "032x") for s in spans if s.name == "hybridserve.step"]
    assert [line["trace_id"] for line in lines] == step_traces and len(set(step_traces)) == len(lines)
    assert all(0 <= line["wall_s"] < 60 for line in lines)
    request_traces = {
        s.attributes["hybridserve.request_id"]: format(s.context.trace_id, "032x")
        for s in spans
        if s.name == "hybridserve.request"
    }
    events = [e for line in lines for e in line.get("request_events", ())]
    assert sorted((e["request_id"], e["event"]) for e in events) == sorted(
        (rid, kind) for rid in request_traces for kind in ("queued", "finished")
    )
    for e in events:
        assert e["trace_id"] == request_traces[e["request_id"]]
        if e["event"] == "finished":
            assert e["reason"] == "length" and e["completion_tokens"] == 5
            # a step's line is written after the step, with the "finished" events of the requests it ended
            assert e["arrival_unix_s"] <= e["first_token_unix_s"] <= e["finish_unix_s"] <= time.time()

    assert all(r.is_identical for r in replay_file(record))  # replay reads the new keys' files
    assert cli.main(["replay", str(record)]) == 0
    html, perfetto = tmp_path / "steps.html", tmp_path / "steps.json"
    args = ["timeline", str(record), "-o", str(html), "--perfetto", str(perfetto), "--jaeger-url", "http://j:16686"]
    assert cli.main(args) == 0
    page = html.read_text()
    assert all(t in page for t in [*step_traces, *request_traces.values()])
    assert f"{len(lines)} steps, 3 requests" in capsys.readouterr().out
    lanes = build_timeline(load_records(record)).lanes
    assert {lane.request_id: lane.trace_id for lane in lanes} == request_traces
    assert all(lane.finish_reason == "length" for lane in lanes)


def queued(rid: str, arrival: float) -> RequestQueued:
    return RequestQueued(rid, 3, 4, 0, 1.0, 1.0, 0, None, (), arrival)


def finished(rid: str, arrival: float, reason: FinishReason) -> RequestFinished:
    return RequestFinished(rid, reason, None, 3, 0, 1, arrival, time.monotonic())


def test_events_ride_on_the_next_recorded_line_and_cost_nothing_unsampled(tmp_path):
    step = seed_step()
    plan = plan_step(step)
    path = tmp_path / "s.jsonl"
    recorder = StepRecorder(path)
    arrival = time.monotonic()
    recorder.request_queued(queued("r1", arrival))
    recorder.record(0, step, plan, 0.001, wall_s=0.002)
    recorder.request_first_token(FirstToken("r1", arrival, time.monotonic()))
    recorder.request_finished(finished("r1", arrival, FinishReason.STOP))
    recorder.record(1, step, plan, 0.001)  # an older caller: no wall time
    recorder.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in lines[0]["request_events"]] == ["queued"] and lines[0]["wall_s"] == 0.002
    assert lines[1]["request_events"][0]["reason"] == "stop" and "wall_s" not in lines[1]
    assert "trace_id" not in lines[0] and lines[0]["request_events"][0]["trace_id"] == ""

    off = StepRecorder(tmp_path / "off.jsonl", sample_rate=0.0)
    off.request_queued(queued("r2", time.monotonic()))
    off.request_finished(finished("r2", time.monotonic(), FinishReason.ABORT))
    assert off._pending == []
    off.close()


def test_old_files_load_and_bad_input_is_refused(tmp_path, capsys):
    step = seed_step()
    recorder = StepRecorder(tmp_path / "new.jsonl")
    recorder.record(7, step, plan_step(step), 0.001, wall_s=0.01)
    recorder.close()
    old = tmp_path / "old.jsonl"  # what recorders before the timeline wrote
    line = json.loads((tmp_path / "new.jsonl").read_text())
    old.write_text(json.dumps({k: line[k] for k in ("step_index", "request", "plan", "plan_latency_s", "time_unix_s")}))
    timeline = build_timeline(load_records(old))
    assert [s.step_index for s in timeline.steps] == [7] and [lane.request_id for lane in timeline.lanes] == [
        "d0", "p0", "p1", "p2"
    ]  # fmt: skip
    assert timeline.steps[0].reproduces is True and timeline.steps[0].plan_text.startswith("step 7: quantum 2048,")

    out = str(tmp_path / "o.html")
    assert cli.main(["timeline", str(old), "-o", out, "--jaeger-url", "localhost:16686"]) == 2
    assert "--jaeger-url 'localhost:16686': expected http://HOST:PORT" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert cli.main(["timeline", str(empty), "-o", out]) == 2
    assert "holds no recorded steps" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step_index": 1}\n')
    assert cli.main(["timeline", str(bad), "-o", out]) == 2
    assert "bad.jsonl:1: not a step record" in capsys.readouterr().err
    assert cli.main(["timeline", str(tmp_path / "missing.jsonl"), "-o", out]) == 2
