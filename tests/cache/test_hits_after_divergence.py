"""Hits after divergence: multi-turn chats (10 conversations x 5 turns, turns not block multiples)
and a shared system prompt reuse every full block before the divergence: the hits offered reach
>= 95% of the ideal computed offline from the prompts. The chats alternate between two workers that
share a real cache service and Redis, so most hits cross workers; hits the fetch-or-recompute rule
declines are counted apart (GetInfo prefix_cache_declined_tokens) and still count as offered."""

from __future__ import annotations

import random

from scheduler_svc.core import MambaCacheMode, SchedulerConfig
from tests.cache.served import serve
from tests.cache.workloads import shared_blocks, system_prompt_workload, turn_tokens

__all__ = ["serve"]

BLOCK = 16
VOCAB = 120
CONFIG = SchedulerConfig(
    max_num_batched_tokens=256, max_num_seqs=4, block_size=BLOCK, mamba_block_size=8, kv_page_size=4,
    mamba_cache_mode=MambaCacheMode.NONE, long_prefill_token_threshold=96,
)  # fmt: skip


def test_multi_turn_chats_across_two_workers_reach_95_percent_of_the_ideal(serve, checkpoint, cache_service):
    workers = [
        serve(checkpoint, CONFIG, prefix_caching=True, cache_address=cache_service.address, num_checkpoint_slots=256)
        for _ in range(2)
    ]  # fmt: skip
    rng = random.Random(0)
    conversations: list[list[int]] = [turn_tokens(rng, 20, 60, VOCAB) for _ in range(10)]
    seen: list[list[int]] = []
    ideal = offered = 0
    for turn in range(5):
        for c, prompt in enumerate(conversations):
            worker = workers[(c + turn) % 2]
            ideal += shared_blocks(prompt, seen, BLOCK) * BLOCK
            reply, _, cached = worker.run(prompt, max_tokens=7)
            offered += cached
            seen.append(prompt)
            assert worker.engine.prefix.shared.flush()
            conversations[c] = prompt + reply + turn_tokens(rng, 9, 41, VOCAB)
    declined = sum(w.info().prefix_cache_declined_tokens for w in workers)
    assert ideal > 0
    print(f"multi-turn: offered {offered} + declined {declined} tokens of an ideal {ideal}")
    assert offered + declined >= 0.95 * ideal, (offered, declined, ideal)


def test_a_shared_system_prompt_diverging_mid_block_reaches_95_percent_of_the_ideal(serve, checkpoint):
    worker = serve(checkpoint, CONFIG, prefix_caching=True)
    prompts = system_prompt_workload(20, 6 * BLOCK + 7, VOCAB, seed=1)
    ideal = sum(shared_blocks(p, prompts[:i], BLOCK) * BLOCK for i, p in enumerate(prompts))
    offered = sum(worker.run(p, max_tokens=2)[2] for p in prompts)
    assert ideal == 19 * 6 * BLOCK
    print(f"system prompt: offered {offered} tokens of an ideal {ideal}")
    assert offered >= 0.95 * ideal, (offered, ideal)
