"""`hybridserve qualify`: two scheduler/worker profiles on the same seeded closed-loop workload, judged
by the qualification gates (docs/design.md, How quality is judged). `gates` is pure; `workload`
drives a worker; `command` runs both."""
