"""Prefix caching end to end: a worker with the local tier and the shared tier (real cache_svc over
a real Redis). Hits compute only the suffix and give exactly the cold run's tokens and logprobs."""

from __future__ import annotations

import pytest

from cache_svc import keys
from cache_svc.embedded_redis import RedisProcess
from gpu_worker.engine.observer import EngineObserver
from gpu_worker.engine.records import CacheLookup
from gpu_worker.runner.checkpoint_io import HEAD_BYTES, BlockCheckpoint, BlockIdentity, seal
from hybridserve.v1 import generation_pb2 as pb
from tests.worker.conftest import SCHEDULER, SHARED_ACCESS, collect, greedy_request, prompt_of

BLOCK = SCHEDULER.block_size
PREFIX = prompt_of(4 * BLOCK, 77)  # a 4-block shared prefix


def run(worker, prompt: list[int], max_tokens: int = 12) -> tuple[list[int], list[float], pb.Usage]:
    """Greedy tokens, and per token the chosen logprob plus the top 5 (a slice of the logits that a
    wrong KV or state would move), and the usage."""
    tokens, messages = collect(worker.stub.Generate(greedy_request(prompt, max_tokens, logprobs=5), timeout=60))
    logprobs = [lp for m in messages for lp in m.logprobs]
    top = [lp for m in messages for t in m.top_logprobs for lp in t.logprobs]
    assert len(top) == 5 * len(tokens)
    return tokens, logprobs + top, messages[-1].usage


@pytest.fixture
def cold(start_worker):
    """Reference outputs from a worker without any cache."""
    worker = start_worker(prefix_caching=False)
    return lambda prompt: run(worker, prompt)[:2]


def assert_same(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-4


class LookupLog(EngineObserver):
    def __init__(self) -> None:
        self.lookups: list[tuple[str, bool]] = []

    def cache_lookup(self, event: CacheLookup) -> None:
        self.lookups.append((event.tier, event.hit))


def test_a_shared_4_block_prefix_computes_only_the_suffix(start_worker, cold):
    log = LookupLog()
    worker = start_worker(prefix_caching=True, observer=log)
    lookups = log.lookups
    first = PREFIX + prompt_of(5, 1)
    second = PREFIX + prompt_of(9, 2)
    tokens, logprobs, usage = run(worker, first)
    assert usage.cached_tokens == 0
    assert_same((tokens, logprobs), cold(first))
    before = worker.engine.counters.num_computed_tokens
    tokens, logprobs, usage = run(worker, second)
    assert usage.cached_tokens == 4 * BLOCK
    computed = worker.engine.counters.num_computed_tokens - before
    assert computed == 9 + 12 - 1, "only the suffix and the decodes ran"
    assert_same((tokens, logprobs), cold(second))
    assert lookups == [("worker", False), ("worker", True)]


def test_a_restarted_worker_hits_in_redis(start_worker, cold, cache_service):
    first = start_worker(prefix_caching=True, cache_address=cache_service.address)
    run(first, PREFIX + prompt_of(3, 3))
    assert first.engine.prefix.shared.flush()
    assert first.engine.prefix.shared.num_published >= 4
    second = start_worker(prefix_caching=True, cache_address=cache_service.address)  # empty local tier
    prompt = PREFIX + prompt_of(6, 4)
    tokens, logprobs, usage = run(second, prompt)
    assert usage.cached_tokens == 4 * BLOCK
    assert second.engine.prefix.num_shared_hits >= 4
    assert_same((tokens, logprobs), cold(prompt))


def damage(redis_client, how: str) -> int:
    """Damages every stored checkpoint in one way; returns how many."""
    from safetensors.torch import load

    count = 0
    for key in redis_client.scan_iter("hybridserve:v2:blk:*"):
        data = redis_client.hget(key, keys.FIELD_DATA)
        if how == "flip":
            damaged = bytearray(data)
            damaged[len(damaged) // 2] ^= 0x55
            redis_client.hset(key, keys.FIELD_DATA, bytes(damaged))
        elif how == "fingerprint":
            redis_client.hset(key, keys.FIELD_FINGERPRINT, "0" * 64)
        elif how == "kv_without_state":  # genuine (sealed with the workers' key) but without the state
            import hashlib
            import json
            import struct

            body = data[HEAD_BYTES:]
            meta = json.loads(body[8 : 8 + struct.unpack("<Q", body[:8])[0]])["__metadata__"]
            identity = BlockIdentity(
                bytes.fromhex(meta["block_hash"]), bytes.fromhex(meta["parent_hash"]), int(meta["block_size"]),
                meta["fingerprint"],
            )  # fmt: skip
            block = BlockCheckpoint(kv=load(body)["kv"], conv=None, ssm=None)
            kv_only = seal(block, identity, SHARED_ACCESS.checkpoint_key)
            redis_client.hset(
                key, mapping={keys.FIELD_DATA: kv_only, keys.FIELD_SHA256: hashlib.sha256(kv_only).hexdigest()}
            )
        count += 1
    return count


@pytest.mark.parametrize("how", ["flip", "fingerprint", "kv_without_state"])
def test_bad_checkpoints_in_redis_are_misses_with_correct_outputs(start_worker, cold, cache_service, redis_server, how):
    first = start_worker(prefix_caching=True, cache_address=cache_service.address)
    run(first, PREFIX + prompt_of(3, 5))
    assert first.engine.prefix.shared.flush()
    assert damage(redis_server.client(), how) >= 4
    second = start_worker(prefix_caching=True, cache_address=cache_service.address)
    prompt = PREFIX + prompt_of(7, 6)
    tokens, logprobs, usage = run(second, prompt)
    assert usage.cached_tokens == 0
    assert_same((tokens, logprobs), cold(prompt))


def test_redis_killed_mid_run_then_restarted(start_worker, cold, cache_service, redis_server):
    worker = start_worker(prefix_caching=True, cache_address=cache_service.address)
    run(worker, PREFIX + prompt_of(3, 8))
    redis_server.kill()
    for seed in range(3):  # the shared tier is down: misses there, requests still complete
        prompt = prompt_of(4 * BLOCK + 3, 100 + seed)
        assert_same(run(worker, prompt)[:2], cold(prompt))
    restarted = RedisProcess(port=redis_server.port)
    try:
        run(worker, prompt_of(4 * BLOCK, 55) + [7])
        assert worker.engine.prefix.shared.flush()
        fresh = start_worker(prefix_caching=True, cache_address=cache_service.address)
        prompt = prompt_of(4 * BLOCK, 55) + prompt_of(5, 9)
        tokens, logprobs, usage = run(fresh, prompt)
        assert usage.cached_tokens == 4 * BLOCK, "hits resume once Redis is back"
        assert_same((tokens, logprobs), cold(prompt))
    finally:
        restarted.stop()


def test_local_tier_evicts_least_recently_used_blocks_when_pages_run_short(start_worker, cold):
    """A pool of 48 pages (12 blocks of KV) and six distinct 4-block prefixes: cached blocks are
    evicted, least recently used first, to serve new requests; outputs stay correct."""
    worker = start_worker(prefix_caching=True, num_kv_pages=48)
    prefixes = [prompt_of(4 * BLOCK, 500 + i) for i in range(6)]
    for i, prefix in enumerate(prefixes):
        prompt = prefix + prompt_of(3, i)
        assert_same(run(worker, prompt)[:2], cold(prompt))
    info = worker.info()
    assert info.num_kv_pages_free + worker.engine.prefix.local.reclaimable_pages() == info.num_kv_pages_total
    newest = run(worker, prefixes[-1] + prompt_of(4, 99))
    assert newest[2].cached_tokens == 4 * BLOCK, "the most recent prefix is still cached"
    oldest = run(worker, prefixes[0] + prompt_of(4, 98))
    assert oldest[2].cached_tokens == 0, "the least recently used prefix was evicted"
    prompt = prefixes[0] + prompt_of(4, 98)
    assert_same(oldest[:2], cold(prompt))
