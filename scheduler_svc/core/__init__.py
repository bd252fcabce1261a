"""The pure planning core. Imports nothing but the standard library and hybridserve.errors;
tests/scheduler/test_layering.py fails if an edge library (grpc, protobuf, torch, redis) creeps in."""

from scheduler_svc.core.config import MambaCacheMode, SchedulerConfig
from scheduler_svc.core.plan import PlanStats, Slice, StepPlan
from scheduler_svc.core.planner import plan_step
from scheduler_svc.core.share import PrefillShareMode, ShareState
from scheduler_svc.core.state import PinnedPages, RequestState, StepInput

__all__ = [
    "MambaCacheMode",
    "PinnedPages",
    "PlanStats",
    "PrefillShareMode",
    "RequestState",
    "SchedulerConfig",
    "ShareState",
    "Slice",
    "StepInput",
    "StepPlan",
    "plan_step",
]
