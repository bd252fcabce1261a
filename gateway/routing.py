"""Worker choice: pure functions, no I/O (tests/gateway/test_routing.py holds their properties).

The cost of sending a request to a worker is counted in prompt tokens of work:

    cost(worker) = uncached_tokens(worker) + queued_prefill_tokens(worker)
                   + active_requests(worker) * request_cost_tokens

where uncached_tokens is the prompt part the worker would have to prefill (its leading blocks that
the gateway last sent to that worker count as cached), queued_prefill_tokens the prefill still ahead
of it there (requests sent but not yet streaming), and request_cost_tokens prices each request
running or waiting there (a decode slows every step a little). A prefix sticks to its worker until
the wait there costs more than computing the prefix elsewhere.

The cheapest worker wins; ties go to the highest rendezvous weight of (prefix key, worker), so equal
workers split distinct prefixes evenly and a given prefix keeps choosing the same worker while loads
are equal."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

# Leading blocks hashed per prompt: enough for long system prompts on small grids, bounded so that
# hashing stays microseconds per request.
MAX_PREFIX_BLOCKS = 256


@dataclass(frozen=True, slots=True)
class Candidate:
    """One ready worker as the router sees it."""

    address: str  # host:port of the worker
    num_matched_blocks: int  # leading prompt blocks last sent to this worker (assumed cached there)
    num_active_requests: int  # requests running or waiting on it
    num_queued_prefill_tokens: int = 0  # prompt tokens sent to it and not yet prefilled (estimated)


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """The weights of the cost function."""

    block_size_tokens: int  # tokens per prefix block (the workers' cache grid)
    request_cost_tokens: int = 64  # one active request, priced in prefill tokens
    prefix_aware: bool = True  # False: cached blocks are ignored (load and rendezvous only)


def prefix_block_hashes(
    tokens: Sequence[int] | str, block_size: int, max_blocks: int = MAX_PREFIX_BLOCKS, salt: str = ""
) -> tuple[int, ...]:
    """Chained hashes of the prompt's leading full blocks: hash i covers blocks [0, i], so two prompts
    share hash i exactly when they share their first i + 1 blocks (as the workers' cache keys do). A
    cache salt roots the chain, as on the workers: prompts of different salts share no block.

    A text prompt (no tokenizer at the gateway) is cut into blocks of block_size characters: an
    approximation of the token grid, still the same for two prompts with the same leading text."""
    if block_size < 1:
        return ()
    hashes: list[int] = []
    parent = hash(("cache_salt", salt)) if salt else 0
    num_blocks = min(len(tokens) // block_size, max_blocks)
    for i in range(num_blocks):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        parent = hash((parent, chunk if isinstance(chunk, str) else tuple(chunk)))
        hashes.append(parent)
    return tuple(hashes)


def rendezvous_weight(prefix_key: int, address: str) -> int:
    """Highest-random-weight hashing: a stable pseudo-random weight per (key, worker), so a key's
    favourite worker changes only when that worker leaves, and keys spread evenly over workers."""
    digest = hashlib.blake2b(f"{prefix_key}/{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def cost_tokens(candidate: Candidate, num_prompt_blocks: int, policy: RoutingPolicy) -> int:
    """Prefill tokens this worker would compute plus its load priced in tokens (see the module note)."""
    matched = min(candidate.num_matched_blocks, num_prompt_blocks) if policy.prefix_aware else 0
    uncached = (num_prompt_blocks - matched) * policy.block_size_tokens
    return uncached + candidate.num_queued_prefill_tokens + candidate.num_active_requests * policy.request_cost_tokens


def choose_worker(
    candidates: Sequence[Candidate], prefix_key: int, num_prompt_blocks: int, policy: RoutingPolicy
) -> str:
    """The address of the cheapest candidate, ties broken by rendezvous weight. Needs one candidate."""
    if not candidates:
        raise ValueError("no candidate workers")
    best = min(
        candidates,
        key=lambda c: (cost_tokens(c, num_prompt_blocks, policy), -rendezvous_weight(prefix_key, c.address)),
    )
    return best.address


def round_robin(addresses: Sequence[str], counter: int) -> str:
    """The baseline policy: the counter-th of the sorted addresses, ignoring prefixes and load."""
    if not addresses:
        raise ValueError("no candidate workers")
    ordered = sorted(addresses)
    return ordered[counter % len(ordered)]
