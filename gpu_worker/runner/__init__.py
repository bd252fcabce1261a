"""The model runner: runs one packed batch on the model and owns what the forward reads and writes,
the KV page pool, the Mamba state pool and their checkpoint I/O; in the worker's process, or in
model processes that map the pools as shared memory (model_process.py)."""
