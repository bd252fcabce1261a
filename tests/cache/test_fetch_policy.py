"""The fetch-or-recompute rule (gpu_worker/cache/misses.py): pure, from measured speeds."""

from __future__ import annotations

from gpu_worker.cache.misses import FetchOrRecompute


def test_unmeasured_fetches_so_that_it_measures():
    policy = FetchOrRecompute(bytes_per_block=1_000_000, tokens_per_block=256)
    assert policy.decide(4).fetch
    policy.record_prefill(256, 1.0)
    assert policy.decide(4).fetch, "one speed alone decides nothing"


def test_the_faster_of_fetching_and_computing_wins():
    policy = FetchOrRecompute(bytes_per_block=1_000_000, tokens_per_block=256)
    policy.record_fetch(100_000_000, 1.0)  # 100 MB/s: 10 ms a block
    policy.record_prefill(2560, 1.0)  # 2560 tokens/s: 100 ms a block
    decision = policy.decide(3)
    assert decision.fetch and decision.name == "fetch"
    assert abs(decision.expected_fetch_s - 0.03) < 1e-9 and abs(decision.expected_recompute_s - 0.3) < 1e-9
    for _ in range(20):  # the link slows to 1 MB/s: 1 s a block; the moving average follows
        policy.record_fetch(1_000_000, 1.0)
    assert not policy.decide(3).fetch and policy.decide(3).name == "recompute"


def test_zero_or_negative_samples_are_ignored():
    policy = FetchOrRecompute(bytes_per_block=1, tokens_per_block=1)
    policy.record_fetch(0, 1.0)
    policy.record_prefill(10, 0.0)
    assert policy.fetch_bytes_per_s is None and policy.prefill_tokens_per_s is None
