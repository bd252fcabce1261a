"""Step recording as an observer: a sample of the steps' scheduler input and plan, to a JSONL file
for `hybridserve replay` and `hybridserve timeline` (the format is StepRecorder's), with the
requests' events.

The engine reports the requests a step ended after the step itself, so a step's line is held until
the next step (or close) and written then, carrying those requests' "finished" events."""

from __future__ import annotations

from typing import Any

from gpu_worker.engine.observer import EngineObserver
from gpu_worker.engine.records import FirstToken, RequestFinished, RequestQueued, StepRecord
from gpu_worker.step_recorder import StepRecorder


class RecordingObserver(EngineObserver):
    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder
        self._last: tuple[int, bytes] | None = None  # (step index, serialized PlanStepRequest)
        self._held: dict[str, Any] | None = None  # the last step's line, written at the next step

    def request_queued(self, event: RequestQueued) -> None:
        self.recorder.request_queued(event)

    def request_first_token(self, event: FirstToken) -> None:
        self.recorder.request_first_token(event)

    def request_finished(self, event: RequestFinished) -> None:
        self.recorder.request_finished(event)

    def step_finished(self, record: StepRecord) -> None:
        self._write_held()
        self._last = None
        if record.step_input is not None and self.recorder.should_record():
            self._held, sent = self.recorder.prepare(
                record.step_index, record.step_input, record.plan, record.plan_latency_s, record.wall_s
            )
            self._last = (record.step_index, sent)

    def _write_held(self) -> None:
        if self._held is not None:
            self.recorder.write(self._held)
            self._held = None

    def recorded_input(self, step_index: int) -> bytes | None:
        """The serialized scheduler input of step `step_index` if that step was just recorded."""
        if self._last is None or self._last[0] != step_index:
            return None
        return self._last[1]

    def close(self) -> None:
        self._write_held()
        self.recorder.close()
