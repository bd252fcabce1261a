"""Shared plumbing of the hybridserve services: the CLI's dispatch, generated protobuf modules
(`hybridserve.v1`), gRPC server helpers and telemetry set-up. Service logic lives in
`scheduler_svc`, `gpu_worker` and `cache_svc`."""

__version__ = "0.1.0"
