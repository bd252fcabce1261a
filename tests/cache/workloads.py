"""Prefix-sharing workloads and their ideal hit counts, computed offline from the prompts.

Multi-turn chat: each conversation's next prompt is its previous prompt, the model's reply and a new
user turn (lengths not multiples of the block), so a turn shares all of the previous prompt. Shared
system prompt: one system prompt (not a block multiple) before distinct questions, so requests
diverge mid-block. The ideal hit of a prompt is the longest run of full blocks it shares with an
earlier prompt, leaving at least one token to compute (the worker never caches the last token)."""

from __future__ import annotations

import random


def turn_tokens(rng: random.Random, low: int, high: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(rng.randrange(low, high))]


def shared_blocks(prompt: list[int], earlier: list[list[int]], block_size: int) -> int:
    """Full blocks of `prompt` (at most (len - 1) // block_size) equal to an earlier prompt's."""
    usable = (len(prompt) - 1) // block_size
    best = 0
    for other in earlier:
        same = 0
        for a, b in zip(prompt, other, strict=False):
            if a != b:
                break
            same += 1
        best = max(best, min(same // block_size, usable))
    return best


def system_prompt_workload(num_requests: int, system_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_len)]
    return [system + turn_tokens(rng, 5, 40, vocab) for _ in range(num_requests)]
