"""The Scheduler gRPC servicer: converts in, calls the pure planner, converts out. Errors raised by
the core are mapped to status codes by hybridserve.grpc_server.DomainErrorInterceptor."""

from __future__ import annotations

import grpc

from hybridserve import grpc_server
from hybridserve.v1 import scheduler_bench_pb2 as bench_pb
from hybridserve.v1 import scheduler_pb2 as pb
from hybridserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc import convert
from scheduler_svc.core import StepPlan, plan_step
from scheduler_svc.core.steady import plan_steady_decodes


def plan_request(request: pb.PlanStepRequest) -> StepPlan:
    """The plan of one PlanStep request: a steady decode step sent as columns is planned from its
    columns (core/steady.py); any other step, or one that path declines, by plan_step."""
    if (
        request.HasField("config")
        and request.HasField("running_columns")
        and not (request.running or request.waiting or request.pinned_kv_pages)
    ):
        plan = plan_steady_decodes(
            convert.config_from_pb(request.config),
            convert.columns_from_pb(request.running_columns),
            len(request.waiting_columns.request_id),
            request.step_index,
            request.num_free_kv_pages,
            convert.share_from_pb(request),
        )
        if plan is not None:
            return plan
    return plan_step(convert.step_from_pb(request))


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def PlanStep(self, request: pb.PlanStepRequest, context: grpc.ServicerContext) -> pb.PlanStepResponse:
        return convert.plan_to_pb(plan_request(request), convert.is_columnar(request))

    def ValidateConfig(self, request: pb.SchedulerConfig, context: grpc.ServicerContext) -> pb.ValidateConfigResponse:
        config = convert.config_from_pb(request).validate()
        return pb.ValidateConfigResponse(
            quantum=config.quantum,
            sub_block_exception=config.sub_block_exception,
            warnings=config.warnings(),
        )


class SchedulerBenchServicer:
    """The benchmark-only SchedulerBench service: the floor PlanStep's round trip is measured against."""

    def Echo(self, request: bench_pb.EchoRequest, context: grpc.ServicerContext) -> bench_pb.EchoResponse:
        return bench_pb.EchoResponse(payload=request.payload)


def add_to_server(server: grpc.Server) -> str:
    return grpc_server.add_servicer(server, pb.DESCRIPTOR.services_by_name["Scheduler"], SchedulerServicer())


def add_bench_to_server(server: grpc.Server) -> str:
    return grpc_server.add_servicer(
        server, bench_pb.DESCRIPTOR.services_by_name["SchedulerBench"], SchedulerBenchServicer()
    )
