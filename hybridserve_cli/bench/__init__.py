"""`hybridserve bench`: the one load driver of the project (the command, `qualify`'s workloads and the
benchmarks under bench/ all run on it).

    datasets.py  what is sent: random, sharegpt, multiturn, trace -> BenchRequest (exact token counts)
    driver.py    when and how: open loop (Poisson / gamma arrivals, max concurrency), closed loop
                 (N clients), a trace's own clock; OpenAI HTTP (streamed) or gRPC backends
    results.py   what it measured: vLLM bench serve's metrics and JSON keys, goodput, the table
    command.py   the command line, the progress bar, --save-result and --plot
"""
