"""The GPU worker, by part:

    api/        `hybridserve worker`, the Generation servicer, health and drain, the client side
    engine/     the step loop: requests, plans from the scheduler service, batches, outputs
    runner/     runs a batch on the model; owns the KV page pool, the Mamba state pool, model processes
    model/      the hybrid model families, the checkpoint loader, the tokenizer, backends/ for kernels
    cache/      the prefix cache (local tier, shared tier through cache_svc)
    observers/  tracing, metrics and step recording, fed by the engine's frozen records

docs/development.md says what lives where and why."""
