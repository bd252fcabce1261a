"""Start to readiness, and what the first requests after it cost: a worker that reports ready once warm
(the default) against one started with --serve-while-warming, alternately, each from a cold inductor
cache of its own (a first start) unless --warm-cache.

    .venv/bin/python bench/bench_warmup.py [--model DIR] [--rounds 1] [--requests 8] [--warm-cache]

Per start it prints the seconds to `listening on` (the load), from there to readiness SERVING, the
worker's `warm in` line (each part's time), and the latency of each request sent once ready, one after
the other (a 64-token prompt, 8 greedy tokens): the first against the median of the rest. Without
--model it serves the default model (`hybridserve init-model`). Only figures from one run, side by
side, mean anything.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridserve.children import hybridserve_command
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from hybridserve_cli.stack import Stack

PROMPT = [(7 * i) % 250 + 3 for i in range(64)]
WARM_LINE = re.compile(r"warm in .*")


def request_s(channel: grpc.Channel) -> float:
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True)
    )
    started = time.monotonic()
    for _ in pb_grpc.GenerationStub(channel).Generate(request, timeout=600):
        pass
    return time.monotonic() - started


def one_start(stack: Stack, model: Path, scheduler: str, flags: list[str], cache_dir: Path | None, n: int) -> str:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache_dir)} if cache_dir is not None else {}
    started = time.monotonic()
    worker = stack.worker(model, [scheduler], flags=flags, env=env, name=f"worker{len(stack.services)}")
    listening_s = time.monotonic() - started
    with grpc.insecure_channel(worker.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        probe = health_pb2.HealthCheckRequest(service="readiness")
        while health.Check(probe, timeout=10).status != health_pb2.HealthCheckResponse.SERVING:
            time.sleep(0.02)
        ready_s = time.monotonic() - started - listening_s
        latencies = [request_s(channel) for _ in range(n)]
    warm = next((m.group(0) for m in map(WARM_LINE.search, reversed(worker.child.lines)) if m), "no warm-up")
    worker.child.stop()
    first, rest = latencies[0], statistics.median(latencies[1:])
    return (
        f"  listening {listening_s:.1f} s, then ready {ready_s:.1f} s; {warm}\n"
        f"  requests s: {' '.join(f'{x:.3f}' for x in latencies)}; first {first:.3f} / median of the rest "
        f"{rest:.3f} = {first / rest:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--warm-cache", action="store_true", help="share inductor's default cache (a later start)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-warmup-") as tmp, Stack(die_with_parent=False) as stack:
        model = args.model
        if model is None:
            model = Path(tmp) / "default"
            stack.run_once("init-model", hybridserve_command("init-model", str(model)))
        scheduler = stack.scheduler()
        for round_index in range(args.rounds):
            for name, flags in (("ready when warm", []), ("--serve-while-warming", ["--serve-while-warming"])):
                cache = None if args.warm_cache else Path(tmp) / f"inductor-{round_index}-{len(flags)}"
                print(f"{name} (round {round_index + 1}):", flush=True)
                print(one_start(stack, model, scheduler, flags, cache, args.requests), flush=True)


if __name__ == "__main__":
    main()
