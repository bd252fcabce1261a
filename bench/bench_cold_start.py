"""Cold start to readiness: how long a worker takes from its spawn to readiness SERVING, split into what
comes before the load (the interpreter and its imports), the load (the loader's "weights loaded" line:
read, hash and place the weights), the rest until the server listens (pools, model processes), and the
warm-up until readiness (GetInfo's warm-up figures); and what the first request after readiness costs
against the steady median of the ones after it.

Checkpoints: the default model, and a random Granite-4.0-H of about 1 GB in float32 (vocabulary 100,352)
served from its folder and by id from a hub cache (the same files in the cache's layout, read with
HF_HUB_OFFLINE=1). Before every start the checkpoint's files are dropped from the page cache
(posix_fadvise DONTNEED), so the load reads the disk; `dd iflag=direct` gives the disk's sequential
read on the same file, and the load's rate is the checkpoint's bytes over the load's seconds.

    python bench/bench_cold_start.py [--rounds 1] [--requests 12] [--skip-1gb] [--tmp DIR]
                                     [--serve-while-warming] [--cold-inductor-cache]

`--serve-while-warming` also starts every checkpoint with that flag (ready once loaded, the warm-up in
the background), alternately with the default, so the first requests' cost compares side by side.
`--cold-inductor-cache` gives every start an inductor cache of its own (a first start: the decode
compile from scratch); by default the starts share inductor's cache, as a restarted worker does.

Targets: the weights load at 50% or more of the disk's sequential read; the first request after
readiness costs at most 1.5x the steady median (its end-to-end time, prompt of 64 tokens, 16 new)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_worker.api.client import build_request, generation_stub, stream_completion  # noqa: E402
from hybridserve.v1 import generation_pb2  # noqa: E402
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint  # noqa: E402
from hybridserve_cli.stack import Stack  # noqa: E402

REPO_ID = "bench-org/granite-4.0-h-1gb"
GRANITE_1GB = ModelSpec(
    arch="granitemoehybrid", vocab_size=100352, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
    attn_layer_indices=(3, 7), num_attention_heads=16, num_key_value_heads=4, mamba_n_heads=32, mamba_d_state=128,
)  # fmt: skip
WORKER_FLAGS = ["--max-num-seqs", "8", "--memory-budget-mb", "512", "--device", "cpu"]
# gpu_worker/model/loader.py: MB, the read-and-hash seconds, the build's seconds
LOADED = re.compile(r"weights loaded: ([\d.]+) MB read and hashed in ([\d.]+) s .* in ([\d.]+) s")


@dataclass
class Start:
    """One cold start's timings, seconds from the spawn."""

    label: str  # the checkpoint, and "+ serve-while-warming" for a start with that flag
    checkpoint_bytes: int
    before_load_s: float = 0.0  # the spawn to the load's start (the interpreter, imports, settings)
    loaded_s: float = 0.0  # the loader's read of the weights (every byte touched by the fingerprint's hash)
    build_s: float = 0.0  # the loader's model build (placing the mapped weights; first use of torch's meta refs)
    listening_s: float = 0.0
    ready_s: float = 0.0
    info: dict[str, float | str] = field(default_factory=dict)
    first_e2e_s: float = 0.0
    steady_e2e_s: float = 0.0


def checkpoint_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file())


def drop_from_page_cache(paths: list[Path]) -> None:
    """Asks the kernel to forget the files' cached pages (clean pages go; no root needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_mb_s(path: Path) -> float:
    """dd's sequential read of `path` past the page cache (iflag=direct), MB/s (10^6 bytes)."""
    done = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", done.stderr)
    if match is None:
        raise RuntimeError(f"unexpected dd output: {done.stderr}")
    return int(match.group(1)) / float(match.group(2)) / 1e6


def fill_hub_cache(folder: Path, cache: Path) -> None:
    """`folder`'s files in the hub cache's layout (models--ORG--NAME/{refs,snapshots}) as symlinks, so
    that huggingface_hub resolves REPO_ID offline to them."""
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for path in folder.iterdir():
        link = snapshot / path.name
        if not link.exists():
            link.symlink_to(path.resolve())


def wait_ready(address: str, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.02)
    raise TimeoutError(f"{address} not ready within {timeout_s:.0f} s")


def info_of(address: str) -> dict[str, float | str]:
    with grpc.insecure_channel(address) as channel:
        info = generation_stub(channel).GetInfo(generation_pb2.GetInfoRequest(), timeout=10)
    names = ("warmup_state", "warmup_seconds", "warmup_compile_seconds", "warmup_kernels_seconds",
             "warmup_graphs_seconds", "warmup_steps_seconds", "decode_compile")  # fmt: skip
    return {n: getattr(info, n) for n in names if hasattr(info, n)}


def request_costs(address: str, n: int, vocab: int) -> tuple[float, float]:
    """The first request's end-to-end seconds and the median of the n-1 after it (prompt 64, 16 new)."""
    costs = []
    with grpc.insecure_channel(address) as channel:
        stub = generation_stub(channel)
        for i in range(n):
            prompt = [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(64)]  # distinct: no prefix-cache hit
            done = stream_completion(stub, build_request(prompt, max_tokens=16, ignore_eos=True), timeout_s=300)
            costs.append(done.e2e_s)
    return costs[0], statistics.median(costs[1:])


def cold_start(stack: Stack, scheduler: str, label: str, model: str, files: list[Path], vocab: int,
               args: argparse.Namespace, env: dict[str, str], flags: list[str]) -> Start:  # fmt: skip
    drop_from_page_cache(files)
    start = Start(label, sum(p.stat().st_size for p in files))
    lines: list[tuple[float, str]] = []
    if args.cold_inductor_cache:
        env = env | {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-", dir=args.tmp_dir)}
    spawn = time.monotonic()
    stack.relay = lambda name, line: lines.append((time.monotonic() - spawn, line))
    name = f"worker-{len(stack.services)}"
    service = stack.worker(model, [scheduler], flags=[*WORKER_FLAGS, *flags], env=env, name=name, wait=False)
    address = stack.wait_listening(service.name)
    start.listening_s = time.monotonic() - spawn
    wait_ready(address)
    start.ready_s = time.monotonic() - spawn
    when, match = next(((t, m) for t, line in lines if (m := LOADED.search(line))), (float("nan"), None))
    start.loaded_s = float(match.group(2)) if match else float("nan")
    start.build_s = float(match.group(3)) if match else float("nan")
    start.before_load_s = when - start.loaded_s - start.build_s
    start.info = info_of(address)
    start.first_e2e_s, start.steady_e2e_s = request_costs(address, args.requests, vocab)
    service.child.stop(30)
    stack.relay = None
    return start


def row(label: str, rows: list[Start], disk: dict[str, float]) -> str:
    """One table row: medians over the rounds (warm-up figures 0 for --serve-while-warming, not timed)."""

    def med(key: str) -> float:
        if key.startswith("warmup_"):
            return statistics.median(0.0 if "serve-while" in label else float(s.info.get(key, 0)) for s in rows)
        return statistics.median(float(getattr(s, key)) for s in rows)

    mb = rows[0].checkpoint_bytes / 1e6
    read = med("loaded_s")
    rate = mb / read if read > 0 else float("nan")
    disk_rate = disk.get(label.split(" ")[0], float("nan"))
    first, steady = med("first_e2e_s"), med("steady_e2e_s")
    return (
        f"{label:<42} {mb:>5.0f} {med('before_load_s'):>5.1f} {read:>5.2f} {med('build_s'):>5.2f} {rate:>6.0f}"
        f" {disk_rate:>5.0f} {rate / disk_rate:>9.2f} {med('listening_s'):>6.2f} {med('ready_s'):>6.2f}"
        f" {med('warmup_seconds'):>7.2f} {med('warmup_compile_seconds'):>7.2f}"
        f" {med('warmup_kernels_seconds'):>7.2f} {med('warmup_steps_seconds'):>6.2f}"
        f" {first * 1e3:>6.0f}ms {steady * 1e3:>5.0f}ms {first / steady:>10.2f}"
    )


def report(starts: list[Start], disk: dict[str, float]) -> None:
    print("\ncold start to readiness (seconds from the spawn; medians over the rounds)")
    print(
        f"{'checkpoint':<42} {'MB':>5} {'pre':>5} {'read':>5} {'build':>5} {'MB/s':>6} {'disk':>5} {'read/disk':>9}"
        f" {'listen':>6} {'ready':>6} {'warm-up':>7} {'compile':>7} {'kernels':>7} {'steps':>6} {'1st req':>8}"
        f" {'steady':>7} {'1st/steady':>10}"
    )
    for label in dict.fromkeys(s.label for s in starts):
        print(row(label, [s for s in starts if s.label == label], disk))
    print("\nwarm-up state as GetInfo reported it:", json.dumps({s.label: s.info.get("warmup_state") for s in starts}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="cold starts of each checkpoint (medians)")
    parser.add_argument("--requests", type=int, default=12, help="requests after readiness (the first + steady)")
    parser.add_argument("--skip-1gb", action="store_true", help="only the default model")
    parser.add_argument(
        "--tmp", type=Path, default=None, help="where the checkpoints are written (default: a temp dir)"
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cold-start-", dir=args.tmp))
    try:
        subprocess.run([sys.executable, "-m", "hybridserve_cli", "init-model", str(tmp / "default")],
                       check=True, capture_output=True)  # fmt: skip
        checkpoints: list[tuple[str, str, list[Path], int, dict[str, str]]] = [
            ("default", str(tmp / "default"), checkpoint_files(tmp / "default"), 259, {})
        ]
        if not args.skip_1gb:
            t0 = time.monotonic()
            big = write_random_checkpoint(tmp / "granite-1gb", GRANITE_1GB, seed=0)
            print(f"wrote the 1 GB Granite-4.0-H in {time.monotonic() - t0:.1f} s", file=sys.stderr)
            fill_hub_cache(big, tmp / "hub")
            files = checkpoint_files(big)
            offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp / "hub")}
            checkpoints += [
                ("granite-1gb (folder)", str(big), files, GRANITE_1GB.vocab_size, {}),
                ("granite-1gb (by id)", REPO_ID, files, GRANITE_1GB.vocab_size, offline),
            ]
        disk: dict[str, float] = {}
        for label, _, files, _, _ in checkpoints:
            largest = max(files, key=lambda p: p.stat().st_size)
            disk.setdefault(label.split(" ")[0], disk_read_mb_s(largest))
        modes: list[tuple[str, list[str]]] = [("", [])]
        if args.serve_while_warming:
            modes.append((" + serve-while-warming", ["--serve-while-warming"]))
        starts = []
        with Stack(die_with_parent=False) as stack:
            scheduler = stack.scheduler()
            for _ in range(args.rounds):
                for label, model, files, vocab, env in checkpoints:
                    for suffix, flags in modes:  # alternately: side by side in the same minutes
                        started = cold_start(stack, scheduler, label + suffix, model, files, vocab, args, env, flags)
                        print(f"{started.label}: ready in {started.ready_s:.2f} s ({started.info})", file=sys.stderr)
                        starts.append(started)
        print("disk sequential read (dd iflag=direct, MB/s):", json.dumps({k: round(v) for k, v in disk.items()}))
        report(starts, disk)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
