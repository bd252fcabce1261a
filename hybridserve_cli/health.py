"""`hybridserve health ADDR`: ask a server's grpc.health.v1 service whether it is SERVING.

The probe for container health checks (the image's HEALTHCHECK, compose) where no grpcurl or
grpc_health_probe is installed. Exit codes: 0 SERVING, 1 anything else (NOT_SERVING, unknown
service, no answer in time), each with one line on stderr saying what was seen."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridserve.client_security import (
    ClientSecurity,
    add_client_security_arguments,
    client_security_from_args,
    open_client_channel,
)

# The names every server registers (docs/design.md, The public contract); the empty name means readiness.
SERVICE_NAMES = ("readiness", "liveness")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="host:port of a hybridserve gRPC server")
    parser.add_argument(
        "--service",
        choices=SERVICE_NAMES,
        default="readiness",
        help="readiness: it can serve now (default); liveness: the process can make progress",
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    add_client_security_arguments(parser)


def check(address: str, service: str, timeout_s: float, security: ClientSecurity | None = None) -> tuple[bool, str]:
    """(serving, what was seen) for one health name on one server.

    A server that does not know the name answers NOT_FOUND; the probe then asks for the empty
    name, the server's overall status, which the contract defines as readiness and which a
    server started before the named checks existed still reports. So one image's probe works
    against servers of either age, and a server that answers nothing is never called healthy.
    """
    with open_client_channel(address, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in (service, ""):
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=timeout_s)
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.NOT_FOUND and name:
                    continue
                return False, f"{address} {service or 'readiness'}: {code.name} ({err.details()})"
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address} {service}: {status}"
    return False, f"{address} {service}: no health status"  # unreachable: the empty name never continues


def run(args: argparse.Namespace) -> int:
    serving, seen = check(args.address, args.service, args.timeout, client_security_from_args(args))
    print(seen, file=sys.stdout if serving else sys.stderr, flush=True)
    return 0 if serving else 1
