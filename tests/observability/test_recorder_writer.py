"""The step recorder's writer thread: every line recorded before close() is in the file, in order,
each a step that replays to its recorded plan; lines after close() are dropped."""

from __future__ import annotations

import base64
import json

from gpu_worker.observers.recording import StepRecorder
from hybridserve.v1 import scheduler_pb2 as pb
from scheduler_svc import convert
from scheduler_svc.core import plan_step
from scheduler_svc.replay import replay_file
from tests.scheduler.helpers import seed_step


def test_every_line_before_close_is_written_in_order(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    recorder = StepRecorder(path)
    step = seed_step()
    plan = plan_step(step)
    for i in range(500):
        recorder.record(i, step, plan, 0.001, wall_s=0.002)
    recorder.close()
    recorder.record(500, step, plan, 0.001)  # after close: dropped, no error
    recorder.close()  # a second close is a no-op
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step_index"] for line in lines] == list(range(500)) and recorder.num_recorded == 500
    replayed = replay_file(path, step=7)
    assert len(replayed) == 1 and replayed[0].is_identical
    sent = pb.PlanStepRequest.FromString(base64.b64decode(lines[0]["request"]))
    assert convert.is_columnar(sent) and convert.step_from_pb(sent) == step  # as the worker sends it
