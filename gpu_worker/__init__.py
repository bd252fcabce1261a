"""The GPU worker: the model half (checkpoint loading, the hybrid forward pass over a paged KV cache and a
Mamba state pool, sampling) lives here; the engine loop and gRPC service sit on top of `runner.ModelRunner`."""
