"""The worker's engine: request state, the step loop driven by the scheduler service, streaming."""
