"""Where each served token's CPU goes: scheduler, worker and gateway processes (the same stack as
bench_vs_vllm.py starts, bench/our_stack.py, on the same random Granite-4.0-H checkpoint), driven by the
same closed-loop streamed HTTP load, with each process's CPU time (user + system, from /proc) over the measured run
divided by the output tokens. The worker's time is split by thread: the engine thread (named by its
py-spy dump where py-spy is installed, else the busiest thread), the other threads together (gRPC
streams, planner, health); its model processes (the forward passes) are a column of their own.

    .venv/bin/python bench/bench_served_cpu.py [--clients 8,32] [--mix 16-256] [--max-tokens 64]
        [--decode-compile auto|on|off]

Linux only (/proc). Only figures from one run, side by side, mean anything.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from http_load import run_http_load  # noqa: E402
from our_stack import SERVED_NAME, start_ours, write_model  # noqa: E402
from proc_cpu import cpu_s, threads_cpu_s, tree_cpu_s  # noqa: E402

from hybridserve_cli.loadgen import make_prompts  # noqa: E402
from hybridserve_cli.stack import Stack  # noqa: E402


def engine_thread_id(pid: int) -> int | None:
    """The native id of the worker's `engine` thread, from py-spy's dump (None without py-spy)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return None
    dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60).stdout
    for line in dump.splitlines():  # Thread 12345 (idle): "engine"
        if line.startswith("Thread ") and line.rstrip().endswith('"engine"'):
            return int(line.split()[1], 0)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="8,32")
    parser.add_argument("--mix", default="16-256")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--decode-compile", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--init-std", type=float, default=0.06)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lo, hi = (int(x) for x in args.mix.split("-"))
    clients = [int(c) for c in args.clients.split(",")]
    base = Stack(start_timeout_s=120.0)
    ours: Stack | None = None
    try:
        address = base.scheduler()
        scheduler = base["scheduler"].child
        with tempfile.TemporaryDirectory() as tmp:
            model = write_model("granitemoehybrid", args, Path(tmp))
            ours, _, url = start_ours(model, address, max(clients), args.decode_compile)
            gateway, worker = ours["gateway"].child, ours["worker0"].child
            run_http_load(url, SERVED_NAME, make_prompts(8, 16, 64, args.vocab_size, seed=args.seed + 1000), 4, 8)
            engine_tid = engine_thread_id(worker.pid)
            print(f"CPU ms per 1,000 output tokens, prompts {lo}..{hi}, {args.max_tokens} new tokens, streamed HTTP")
            print(
                f"{'clients':>8}{'tok/s':>9}{'models':>9}{'worker':>9}{'engine':>9}{'others':>9}{'gateway':>9}{'sched':>9}"
            )
            for n in clients:
                prompts = make_prompts(n * args.requests_per_client, lo, hi, args.vocab_size, seed=args.seed + n)
                pids = {"worker": worker.pid, "gateway": gateway.pid, "sched": scheduler.pid}
                before = {k: cpu_s(p) for k, p in pids.items()}
                models_before = tree_cpu_s([worker.pid]) - before["worker"]
                threads_before = threads_cpu_s(worker.pid)
                summary = run_http_load(url, SERVED_NAME, prompts, n, args.max_tokens)
                after = {k: cpu_s(p) for k, p in pids.items()}
                models = tree_cpu_s([worker.pid]) - after["worker"] - models_before
                threads_after = threads_cpu_s(worker.pid)
                per_thread = {t: threads_after[t] - threads_before.get(t, 0.0) for t in threads_after}
                engine = per_thread.get(engine_tid, 0.0) if engine_tid else max(per_thread.values())
                tokens = summary.output_tokens_per_s * summary.wall_s / 1000.0
                used = {k: (after[k] - before[k]) * 1000.0 / tokens for k in pids}
                engine_ms = engine * 1000.0 / tokens
                row = (summary.output_tokens_per_s, models * 1000.0 / tokens, used["worker"], engine_ms,
                       used["worker"] - engine_ms, used["gateway"], used["sched"])  # fmt: skip
                print(f"{n:>8}{row[0]:>9.1f}" + "".join(f"{v:>9.0f}" for v in row[1:]), flush=True)
    finally:
        if ours is not None:
            ours.stop()
        base.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
