"""Generated protobuf and gRPC modules of package hybridserve.v1 (python -m hybridserve.protogen)."""
