"""Records each step's exact scheduler input and the plan it got, one JSON object per line, for
`hybridserve replay`:

    {"step_index": N, "request": base64(PlanStepRequest), "plan": base64(PlanStepResponse),
     "plan_latency_s": float, "time_unix_s": float}

Both messages are serialized deterministically, so a replay that re-plans the request can compare
its plan with the recorded one byte for byte. Runs on the engine thread; each line is flushed so a
crash loses at most the step in flight.
"""

from __future__ import annotations

import base64
import json
import random
import threading
import time
from pathlib import Path

from scheduler_svc import convert
from scheduler_svc.core import StepInput, StepPlan


def encode_step(step_input: StepInput) -> bytes:
    return convert.step_to_pb(step_input).SerializeToString(deterministic=True)


def encode_plan(plan: StepPlan) -> bytes:
    return convert.plan_to_pb(plan).SerializeToString(deterministic=True)


class StepRecorder:
    """Writes a sample of the steps (`sample_rate` 1.0 = every step, seeded so runs repeat)."""

    def __init__(self, path: Path | str, sample_rate: float = 1.0, seed: int = 0) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"--record-sample-rate must be within [0, 1], got {sample_rate}")
        self.path = Path(path)
        self.sample_rate = sample_rate
        self._rng = random.Random(seed)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self.num_recorded = 0

    def should_record(self) -> bool:
        return self.sample_rate >= 1.0 or (self.sample_rate > 0.0 and self._rng.random() < self.sample_rate)

    def record(self, step_index: int, step_input: StepInput, plan: StepPlan, plan_latency_s: float) -> bytes:
        """Writes one line; returns the serialized PlanStepRequest (for a span event)."""
        request = encode_step(step_input)
        line = json.dumps(
            {
                "step_index": step_index,
                "request": base64.b64encode(request).decode("ascii"),
                "plan": base64.b64encode(encode_plan(plan)).decode("ascii"),
                "plan_latency_s": round(plan_latency_s, 6),
                "time_unix_s": round(time.time(), 6),
            },
            separators=(",", ":"),
        )
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
                self._file.flush()
                self.num_recorded += 1
        return request

    def close(self) -> None:
        with self._lock:
            self._file.close()
