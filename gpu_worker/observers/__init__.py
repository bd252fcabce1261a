"""The engine's observers: tracing, metrics and step recording, each a consumer of the engine's
records, combined behind one fan-out."""

from __future__ import annotations

from opentelemetry import trace

from gpu_worker.engine.observer import EngineObserver, FanOut
from gpu_worker.observers.metrics import MetricsObserver
from gpu_worker.observers.recording import RecordingObserver, StepRecorder
from gpu_worker.observers.tracing import TracingObserver
from hybridserve import telemetry
from hybridserve.metrics import WorkerMetrics

__all__ = ["MetricsObserver", "RecordingObserver", "TracingObserver", "build_observers"]


def build_observers(
    tracer_provider: trace.TracerProvider | None = None,
    metrics: WorkerMetrics | None = None,
    recorder: StepRecorder | None = None,
    model_name: str = "",
) -> FanOut:
    """The observers that are on: tracing when a tracer provider is configured (the global one by
    default), metrics and recording when given. Recording comes first, so the step span can carry
    the input it recorded. An empty fan-out (`not is_active`) means no telemetry at all."""
    observers: list[EngineObserver] = []
    recording = RecordingObserver(recorder) if recorder is not None else None
    if recording is not None:
        observers.append(recording)
    if telemetry.tracing_enabled(tracer_provider):
        observers.append(TracingObserver(tracer_provider, model_name, recording))
    if metrics is not None:
        observers.append(MetricsObserver(metrics))
    return FanOut(observers)
