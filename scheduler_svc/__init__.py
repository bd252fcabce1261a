"""The stateless step planner: a pure core (`scheduler_svc.core`) behind a thin gRPC edge."""
