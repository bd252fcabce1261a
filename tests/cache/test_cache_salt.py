"""cache_salt: requests with different salts (or one salted, one not) share no prefix-cache block, in the
worker's local tier or the shared tier (real cache_svc over a real Redis); the same salt hits as before."""

from __future__ import annotations

from cache_svc import keys
from gpu_worker.cache.blocks import chain_hashes, chain_root
from tests.worker.conftest import SCHEDULER, collect, greedy_request, prompt_of

BLOCK = SCHEDULER.block_size
PREFIX = prompt_of(4 * BLOCK, 91)  # a 4-block shared prefix


def cached(worker, prompt: list[int], salt: str = "") -> int:
    request = greedy_request(prompt, 2)
    request.cache_salt = salt
    _, messages = collect(worker.stub.Generate(request, timeout=60))
    return messages[-1].usage.cached_tokens


def test_salts_root_distinct_chains_and_so_distinct_redis_keys():
    tokens = list(range(4 * BLOCK))
    chains = {salt: chain_hashes(tokens, BLOCK, "fp", salt=salt) for salt in ("", "a", "b", "ab")}
    every_hash = [h for chain in chains.values() for h in chain]
    assert len(set(every_hash)) == len(every_hash)  # no block of one chain appears in another
    assert chain_root("") == b"" and len(chain_root("a")) == 32
    salted_keys = {keys.block_key("p", "fp", h) for h in chains["a"]}
    assert not salted_keys & {keys.block_key("p", "fp", h) for h in chains[""] + chains["b"]}
    # a salted chain extended from its known hashes stays salted
    assert chain_hashes(tokens, BLOCK, "fp", chains["a"][:2], salt="a") == chains["a"]


def test_the_local_tier_serves_a_salt_its_own_blocks_only(start_worker):
    worker = start_worker(prefix_caching=True)
    assert cached(worker, PREFIX + prompt_of(5, 1), "tenant-a") == 0
    assert cached(worker, PREFIX + prompt_of(5, 2), "tenant-b") == 0
    assert cached(worker, PREFIX + prompt_of(5, 3)) == 0  # unsalted
    assert cached(worker, PREFIX + prompt_of(5, 4), "tenant-a") == 4 * BLOCK
    assert cached(worker, PREFIX + prompt_of(5, 5), "tenant-b") == 4 * BLOCK
    assert cached(worker, PREFIX + prompt_of(5, 6)) == 4 * BLOCK


def test_the_shared_tier_serves_a_salt_its_own_blocks_only(start_worker, cache_service):
    first = start_worker(prefix_caching=True, cache_address=cache_service.address)
    assert cached(first, PREFIX + prompt_of(3, 7), "tenant-a") == 0
    assert first.engine.prefix.shared.flush() and first.engine.prefix.shared.num_published >= 4
    for salt in ("", "tenant-b"):  # fresh workers (empty local tiers) of another salt or none: misses
        other = start_worker(prefix_caching=True, cache_address=cache_service.address)
        assert cached(other, PREFIX + prompt_of(3, 8), salt) == 0
        assert other.engine.prefix.num_shared_hits == 0
    same = start_worker(prefix_caching=True, cache_address=cache_service.address)
    assert cached(same, PREFIX + prompt_of(3, 9), "tenant-a") == 4 * BLOCK
    assert same.engine.prefix.num_shared_hits >= 4
