"""A hit at every block boundary of a prompt, whatever the chunking: the prompt runs in one chunk
(mamba_cache_mode NONE) or in three (ALIGN, and NONE with chunks ending mid-block), and prompts that
share its first k blocks and diverge mid-block k+1 hit exactly k blocks, with the cold run's greedy
tokens and top-5 logprobs (within 1e-4), for each family."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from scheduler_svc.core import MambaCacheMode, SchedulerConfig
from tests.cache.served import assert_same, serve
from tests.model.model_helpers import SPECS, make_hf_model, save_hf_model

__all__ = ["serve"]

BLOCK = 16
BASE = SchedulerConfig(
    max_num_batched_tokens=128, max_num_seqs=4, block_size=BLOCK, mamba_block_size=8, kv_page_size=4,
    mamba_cache_mode=MambaCacheMode.NONE,
)  # fmt: skip
CHUNKINGS = {
    "one chunk, NONE": (BASE, [4 * BLOCK + 5]),
    "three chunks, ALIGN": (
        replace(BASE, mamba_cache_mode=MambaCacheMode.ALIGN, long_prefill_token_threshold=2 * BLOCK),
        [2 * BLOCK, 2 * BLOCK, 5],
    ),
    "three chunks mid-block, NONE": (replace(BASE, long_prefill_token_threshold=24), [24, 24, 21]),
}
FAMILIES = ("gqa_groups2", "granite_dense", "nemotron_dense")  # bamba, granitemoehybrid, nemotron_h


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {name: save_hf_model(make_hf_model(SPECS[name]), tmp_path_factory.mktemp(name)) for name in FAMILIES}


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_full_block_of_a_prompt_is_a_hit_point(serve, checkpoints, family, chunking):
    config, chunks = CHUNKINGS[chunking]
    vocab = SPECS[family].vocab_size
    cold = serve(checkpoints[family], config, prefix_caching=False)
    warm = serve(checkpoints[family], config, prefix_caching=True)
    prompt = _tokens(vocab, 4 * BLOCK + 5, 1)
    first = warm.run(prompt)
    assert first[2] == 0
    assert warm.chunks.prefill_chunks == chunks, "the prompt ran in the chunking under test"
    assert_same(first, cold.run(prompt))
    for k in (1, 2, 3, 4):  # shares k blocks, diverges 3 tokens into block k + 1
        diverging = prompt[: k * BLOCK + 3] + _tokens(vocab, 5, 10 + k)
        got = warm.run(diverging)
        assert got[2] == k * BLOCK, f"a hit of {k} blocks"
        assert_same(got, cold.run(diverging))
