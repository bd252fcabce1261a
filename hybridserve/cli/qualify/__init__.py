"""`hybridserve qualify`: two scheduler/worker profiles on the same seeded closed-loop workload, judged
by the seed's gates (DESIGN §7). `gates` is pure; `workload` drives a worker; `command` runs both."""
