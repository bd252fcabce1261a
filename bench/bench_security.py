"""What security costs; prints ratios measured side by side in one run.

1. Output tokens/s at 32 closed-loop clients: a scheduler + worker stack (real processes) with mTLS on
   every hop and an API key on Generation, vs the same stack in plaintext. Rounds alternate so drift
   hits both. Target: TLS loses <= 5%.
2. PlanStep round trip (32 running requests) over mTLS vs plaintext, one in-process scheduler each,
   calls interleaved. Target: <= 10% slower.
3. Checkpoint MAC: the MAC alone (GMAC under the salt's subkey), the whole verify (MAC, header and
   layout checks, and read-only tensor views) and seal, per checkpoint, vs the time to fetch it from the
   cache service (gRPC Fetch over a real Redis), for a block of the benchmark model and a 16 MiB one.

    python bench/bench_security.py [--quick] [--clients 32] [--rounds 2] [--requests 96]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import BENCH_SPEC  # noqa: E402

from cache_svc.embedded_redis import RedisProcess  # noqa: E402
from cache_svc.server import create_server as create_cache_server  # noqa: E402
from cache_svc.store import StoreConfig  # noqa: E402
from gpu_worker.runner.checkpoint_io import (  # noqa: E402
    HEAD_BYTES,
    MAGIC,
    SALT_BYTES,
    BlockCheckpoint,
    BlockIdentity,
    CheckpointLayout,
    TensorSpec,
    seal,
    tag_of,
    verify,
)
from hybridserve.certs import write_stack_certs  # noqa: E402
from hybridserve.client_security import ClientSecurity  # noqa: E402
from hybridserve.grpc_auth import with_bearer  # noqa: E402
from hybridserve.tls import TlsSettings  # noqa: E402
from hybridserve.v1 import cache_pb2, cache_pb2_grpc, scheduler_pb2  # noqa: E402
from hybridserve_cli.init_model import write_random_checkpoint  # noqa: E402
from hybridserve_cli.loadgen import make_prompts, run_load  # noqa: E402
from hybridserve_cli.stack import Stack  # noqa: E402
from scheduler_svc.client import SchedulerClient  # noqa: E402
from scheduler_svc.server import create_server as create_scheduler_server  # noqa: E402

API_KEY = "bench-api-key-0123456789"
START_TIMEOUT_S = 180.0


def tls_flags(ca: Path, cert: Path, key: Path) -> list[str]:
    return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(ca), "--tls-ca", str(ca)]


def start_stack(model_dir: Path, certs: tuple[Path, dict[str, tuple[Path, Path]]] | None) -> Stack:
    """scheduler + worker; with certs, mTLS on both and an API key on Generation."""
    ca, files = certs if certs else (None, {})
    stack = Stack(start_timeout_s=START_TIMEOUT_S, die_with_parent=False)
    try:
        address = stack.scheduler(flags=tls_flags(ca, *files["scheduler"]) if ca else [])
        worker_flags = tls_flags(ca, *files["worker"]) if ca else []
        env = {"HYBRIDSERVE_API_KEYS": API_KEY} if ca else {}
        stack.worker(model_dir, [address], flags=[
            "--device", "cpu", "--dtype", "float32", "--memory-budget-mb", "256", "--max-num-seqs", "32", *worker_flags,
        ], env=env)  # fmt: skip
    except BaseException:
        stack.stop()
        raise
    return stack


def throughput(args: argparse.Namespace, model_dir: Path, ca: Path, files: dict[str, tuple[Path, Path]]) -> None:
    prompts = make_prompts(args.requests, 16, 128, BENCH_SPEC.vocab_size, seed=1)
    client_tls = TlsSettings(tls_cert=files["client"][0], tls_key=files["client"][1], tls_ca=ca)
    results: dict[str, list[float]] = {"plaintext": [], "mtls+key": []}
    for round_index in range(args.rounds):
        order = ["plaintext", "mtls+key"] if round_index % 2 == 0 else ["mtls+key", "plaintext"]
        for mode in order:
            secure = mode != "plaintext"
            stack = start_stack(model_dir, (ca, files) if secure else None)
            try:
                worker = stack["worker"].address
                security = ClientSecurity(client_tls, API_KEY) if secure else None
                run_load(worker, prompts[:8], 8, 4, security=security)  # warm-up
                summary = run_load(worker, prompts, args.clients, args.max_tokens, security=security)
                assert summary.requests_failed == 0, summary.errors
                results[mode].append(summary.output_tokens_per_s)
                print(
                    f"  round {round_index + 1} {mode:<10} {summary.output_tokens_per_s:8.1f} output tok/s", flush=True
                )
            finally:
                stack.stop()
    plain, secure_best = max(results["plaintext"]), max(results["mtls+key"])
    print(f"1. output tok/s at {args.clients} clients (best of {args.rounds}): plaintext {plain:.1f}, "
          f"mTLS + API key {secure_best:.1f}; ratio {secure_best / plain:.3f} (target >= 0.95)")  # fmt: skip


def plan_request(num_running: int) -> scheduler_pb2.PlanStepRequest:
    config = scheduler_pb2.SchedulerConfig(
        max_num_batched_tokens=4096, max_num_seqs=64, block_size=256, mamba_block_size=64,
        mamba_cache_mode=scheduler_pb2.MAMBA_CACHE_MODE_ALIGN, kv_page_size=16,
    )  # fmt: skip
    running = [
        scheduler_pb2.RequestState(
            request_id=f"r{i}",
            num_prompt_tokens=300,
            num_computed_tokens=300 + i,
            num_output_tokens=i + 1,
            max_tokens=256,
            arrival_time=float(i),
        )  # fmt: skip
        for i in range(num_running)
    ]
    return scheduler_pb2.PlanStepRequest(config=config, running=running, step_index=7, num_free_kv_pages=10_000)


def plan_round_trip(args: argparse.Namespace, ca: Path, files: dict[str, tuple[Path, Path]]) -> None:
    server_tls = TlsSettings(tls_cert=files["scheduler"][0], tls_key=files["scheduler"][1], tls_client_ca=ca)
    client_tls = TlsSettings(tls_cert=files["worker"][0], tls_key=files["worker"][1], tls_ca=ca)
    plain_server, plain_port, _ = create_scheduler_server()
    tls_server, tls_port, _ = create_scheduler_server(tls=server_tls)
    plain_server.start()
    tls_server.start()
    clients = {"plaintext": SchedulerClient([f"127.0.0.1:{plain_port}"]),
               "mtls": SchedulerClient([f"127.0.0.1:{tls_port}"], tls=client_tls)}  # fmt: skip
    request = plan_request(32)
    samples: dict[str, list[float]] = {name: [] for name in clients}
    try:
        for client in clients.values():
            for _ in range(50):
                client.plan_pb(request)
        for _ in range(args.plan_calls):
            for name, client in clients.items():
                start = time.perf_counter()
                client.plan_pb(request)
                samples[name].append(time.perf_counter() - start)
    finally:
        for client in clients.values():
            client.close()
        plain_server.stop(None)
        tls_server.stop(None)
    plain, secure = statistics.median(samples["plaintext"]), statistics.median(samples["mtls"])
    print(f"2. PlanStep round trip, 32 running, median of {args.plan_calls}: plaintext {plain * 1e6:.0f} us, "
          f"mTLS {secure * 1e6:.0f} us; ratio {secure / plain:.3f} (target <= 1.10)")  # fmt: skip


def bench_block(kv_shape: tuple[int, ...], conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...]) -> BlockCheckpoint:
    return BlockCheckpoint(torch.randn(kv_shape), torch.randn(conv_shape), torch.randn(ssm_shape))


def mac_cost(args: argparse.Namespace) -> None:
    spec = BENCH_SPEC
    num_attention = len(spec.attn_layer_indices)
    num_mamba = spec.num_hidden_layers - num_attention
    d_inner = 2 * spec.hidden_size
    head_dim = spec.hidden_size // spec.num_attention_heads
    blocks = {
        "bench model, block 256": bench_block(
            (num_attention, 2, 256, spec.num_key_value_heads, head_dim),
            (num_mamba, d_inner + 2 * spec.mamba_d_state, 3),
            (num_mamba, spec.mamba_n_heads, d_inner // spec.mamba_n_heads, spec.mamba_d_state),
        ),
        "16 MiB block": bench_block((2, 2, 2048, 8, 64), (4, 4096, 3), (4, 32, 64, 64)),
    }  # fmt: skip
    key, token = os.urandom(32), "bench-cluster-token"
    redis_server = RedisProcess()
    server, port, _, store = create_cache_server(
        StoreConfig(redis_url=redis_server.url, max_memory_bytes=1 << 30, max_model_bytes=0),
        tokens=frozenset({token}),
    )  # fmt: skip
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)])
    stub = cache_pb2_grpc.BlockCacheStub(with_bearer(channel, token))
    try:
        for name, block in blocks.items():
            identity = BlockIdentity(hashlib.sha256(name.encode()).digest(), b"", 256, "f" * 64)
            layout = CheckpointLayout(*(TensorSpec(tuple(t.shape), "F32") for t in (block.kv, block.conv, block.ssm)))
            data = seal(block, identity, key)
            stub.Publish(cache_pb2.PublishRequest(
                model_fingerprint="f" * 64, block_hash=identity.block_hash, block_size=256, checkpoint=data,
                checksum=hashlib.sha256(data).digest()), timeout=60)  # fmt: skip
            seal_s, verify_s, fetch_s, mac_s = [], [], [], []
            for _ in range(args.mac_repeats):
                start = time.perf_counter()
                request = cache_pb2.FetchRequest(model_fingerprint="f" * 64, block_hash=identity.block_hash)
                fetched = b"".join(c.data for c in stub.Fetch(request, timeout=60))
                fetch_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                assert isinstance(verify(fetched, identity, layout, key), BlockCheckpoint)
                verify_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                tag_of(key, fetched[len(MAGIC) : len(MAGIC) + SALT_BYTES], memoryview(fetched)[HEAD_BYTES:])
                mac_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                seal(block, identity, key)
                seal_s.append(time.perf_counter() - start)
            fetch, check, mac, make = (statistics.median(v) for v in (fetch_s, verify_s, mac_s, seal_s))
            print(f"3. {name} ({len(data) / (1 << 20):.2f} MiB): fetch {fetch * 1e3:.2f} ms; MAC {mac * 1e3:.2f} ms "
                  f"(ratio {mac / fetch:.3f} of the fetch); whole verify incl. tensor load {check * 1e3:.2f} ms "
                  f"(ratio {check / fetch:.3f}); seal {make * 1e3:.2f} ms")  # fmt: skip
    finally:
        channel.close()
        server.stop(None)
        store.close()
        redis_server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests and calls (a smoke run)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--plan-calls", type=int, default=2000)
    parser.add_argument("--mac-repeats", type=int, default=20)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.plan_calls, args.mac_repeats, args.rounds = 32, 200, 5, 1
    with tempfile.TemporaryDirectory(prefix="bench-security-") as tmp:
        root = Path(tmp)
        model_dir = write_random_checkpoint(root / "model", BENCH_SPEC, seed=0)
        ca, issued = write_stack_certs(root / "tls", ("scheduler", "worker", "client"))
        files = {name: (f.cert, f.key) for name, f in issued.items()}
        mac_cost(args)
        plan_round_trip(args, ca, files)
        throughput(args, model_dir, ca, files)


if __name__ == "__main__":
    main()
