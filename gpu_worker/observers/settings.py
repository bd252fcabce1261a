"""What the worker's observers need from its configuration (the server turns this into flags)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpu_worker.engine.observer import FanOut
from gpu_worker.observers import build_observers
from gpu_worker.observers.recording import StepRecorder
from hybridserve.errors import InvalidArgumentError
from hybridserve.metrics import WorkerMetrics, check_metrics_compat, process_registry


@dataclass(frozen=True, slots=True)
class ObserverSettings:
    """Tracing itself is configured by the standard OTEL_* variables (hybridserve/telemetry.py)."""

    record_steps: Path | None = None  # append sampled steps to this JSONL file (`hybridserve replay`)
    record_sample_rate: float = 1.0  # fraction of steps recorded, in [0, 1]
    metrics_compat: str = ""  # "vllm": vLLM's series also under their vllm: names (hybridserve.metrics)

    def __post_init__(self) -> None:
        if not 0.0 <= self.record_sample_rate <= 1.0:
            raise InvalidArgumentError(f"--record-sample-rate must be within [0, 1], got {self.record_sample_rate}")
        check_metrics_compat(self.metrics_compat)


def observers_from_settings(settings: ObserverSettings, model_name: str = "") -> FanOut:
    """This process's observers (after start_service_telemetry): metrics when a metrics endpoint
    runs, recording when asked, tracing when configured."""
    registry = process_registry()
    recorder = StepRecorder(settings.record_steps, settings.record_sample_rate) if settings.record_steps else None
    metrics = WorkerMetrics(registry, model_name, settings.metrics_compat) if registry is not None else None
    return build_observers(metrics=metrics, recorder=recorder, model_name=model_name)
