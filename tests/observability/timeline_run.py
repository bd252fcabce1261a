"""A recorded run of real processes for the timeline tests (and the user guide's screenshot): a
`hybridserve scheduler` and a `hybridserve worker --record-steps` with a KV pool small enough to
preempt, a micro-slicing budget, and a few concurrent requests of mixed lengths."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc
from hybridserve_cli.stack import Stack
from tests.observability.conftest import greedy, prompt_of

# (prompt tokens, max tokens): long prompts take several chunks, short ones decode beside them
JOBS = [(90, 12), (20, 24), (70, 10), (36, 20), (110, 6), (52, 16)]
WORKER_FLAGS = [
    "--device", "cpu", "--memory-budget-mb", "1", "--num-checkpoint-slots", "2", "--max-num-seqs", "4",
    "--max-num-batched-tokens", "64", "--max-num-prefill-tokens-per-step", "32", "--block-size", "16",
    "--mamba-block-size", "8", "--kv-page-size", "8", "--record-sample-rate", "1.0",
]  # fmt: skip


@dataclass(frozen=True)
class RecordedRun:
    steps_path: Path
    request_ids: tuple[str, ...]
    info: pb.GetInfoResponse


def record_run(workdir: Path, model_dir: Path | None = None, env: dict[str, str] | None = None) -> RecordedRun:
    """Starts the processes (with `env` added to theirs), serves JOBS concurrently, stops them;
    the steps are in workdir."""
    if model_dir is None:
        model_dir = workdir / "model"
        cmd = [sys.executable, "-m", "hybridserve_cli", "init-model", str(model_dir)]
        subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    steps = workdir / "steps.jsonl"
    stack = Stack(start_timeout_s=60, stop_timeout_s=30, die_with_parent=False, keep_lines=100_000)  # runs gRPC
    try:
        scheduler = stack.scheduler(env=env)
        worker = stack.worker(model_dir, [scheduler], flags=["--record-steps", str(steps), *WORKER_FLAGS], env=env)
        with grpc.insecure_channel(worker.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            def generate(job: tuple[int, int, int]) -> str:
                i, length, max_tokens = job
                request = greedy(prompt_of(length, 100 + i), max_tokens)
                request.request_id = f"req-{i}-p{length}"
                return str(sum(len(m.token_ids) for m in stub.Generate(request, timeout=240)))

            with ThreadPoolExecutor(len(JOBS)) as pool:
                counts = list(pool.map(generate, [(i, n, m) for i, (n, m) in enumerate(JOBS)]))
            assert counts == [str(m) for _, m in JOBS], counts
            info = stub.GetInfo(pb.GetInfoRequest(), timeout=30)
    finally:
        codes = {s.name: stack.terminate(s.name) for s in reversed(stack.services)}  # worker, then scheduler
        assert all(code == 0 for code in codes.values()), [(s.name, s.child.output) for s in stack.services]
    return RecordedRun(steps, tuple(f"req-{i}-p{n}" for i, (n, _) in enumerate(JOBS)), info)
