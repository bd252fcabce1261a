"""Sampling: greedy, temperature/top-k/top-p, the counter-based random stream of seeded rows, logprobs."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.runner.random_stream import stream_key
from gpu_worker.runner.sampling import SamplingParams, sample, sample_rows
from hybridserve.errors import InvalidArgumentError

CPU = torch.device("cpu")


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_logprobs() -> None:
    logits = _logits()
    out = sample(logits, [SamplingParams(num_logprobs=3)] * 4, [0] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, t].item(), abs=1e-5)
        assert out.top_logprobs is not None
        top = out.top_logprobs[i]
        assert [tok for tok, _ in top] == ref[i].topk(3).indices.tolist()
        assert top[0][1] == pytest.approx(out.logprobs[i], abs=1e-6)


def test_a_seeded_draw_depends_on_the_seed_and_position_alone() -> None:
    """The same (seed, position) draws the same token whatever the batch mates and whatever was drawn
    before; successive positions draw afresh."""
    logits = _logits(rows=3)
    p = SamplingParams(temperature=1.3, seed=42)
    draws_alone = [sample(logits[:1], [p], [pos]).token_ids[0] for pos in range(20)]
    mates = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.9, seed=1)]
    draws_batched = [sample(logits, [p, *mates], [pos, 3, pos]).token_ids[0] for pos in reversed(range(20))]
    assert draws_alone == draws_batched[::-1]
    assert len(set(draws_alone)) > 1, "temperature 1.3 over 50 tokens should not be deterministic"
    other_seed = [
        sample(logits[:1], [SamplingParams(temperature=1.3, seed=43)], [pos]).token_ids[0] for pos in range(20)
    ]
    assert other_seed != draws_alone


def test_stream_keys_are_distinct_over_seeds_and_positions() -> None:
    keys = {stream_key(seed, pos) for seed in (-1, 0, 1, 2**63 - 1) for pos in range(1000)}
    assert len(keys) == 4000 and all(0 <= k < 2**64 for k in keys)


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits()
    greedy = logits.argmax(-1).tolist()
    for p in (SamplingParams(temperature=2.0, top_k=1, seed=1), SamplingParams(temperature=2.0, top_p=1e-6, seed=1)):
        assert sample(logits, [p] * 4, [0, 1, 2, 3]).token_ids == greedy


def test_top_k_restricts_support() -> None:
    logits = _logits(rows=1, vocab=30)
    allowed = set(logits[0].topk(5).indices.tolist())
    p = SamplingParams(temperature=5.0, top_k=5, seed=3)
    seen = {sample(logits, [p], [pos]).token_ids[0] for pos in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_the_smallest_covering_set() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=0)
    seen = {sample(logits, [p], [pos]).token_ids[0] for pos in range(300)}
    assert seen == {0, 1}


def test_sampled_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    p = SamplingParams(temperature=1.0, seed=7)
    counts = torch.zeros(3)
    for pos in range(2000):
        counts[sample(torch.log(probs)[None], [p], [pos]).token_ids[0]] += 1
    assert torch.allclose(counts / 2000, probs, atol=0.04)


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"num_logprobs": -2}]
)
def test_invalid_params_are_rejected(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)


def _tied_logits(rows: int = 6, vocab: int = 40) -> torch.Tensor:
    """Small integer logits: most rows have several maximal tokens (argmax takes the first)."""
    return torch.randint(0, 4, (rows, vocab), generator=torch.Generator().manual_seed(5)).float()


def test_plain_rows_cost_no_params_and_match_the_row_by_row_path() -> None:
    logits = _tied_logits()
    fast = sample_rows(logits, (), (), ())
    assert fast.top_logprobs is None
    assert fast.token_ids == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    assert fast.logprobs == pytest.approx([ref[i, t].item() for i, t in enumerate(fast.token_ids)], abs=1e-6)
    # The same rows through the general path (each row asks for one alternative, one mate samples):
    mate = SamplingParams(temperature=1.0, seed=3)
    params = [SamplingParams(num_logprobs=1)] * len(logits) + [mate]
    general = sample(torch.cat([logits, logits[:1]]), params, [0] * (len(logits) + 1))
    assert general.token_ids[:-1] == fast.token_ids
    assert general.logprobs[:-1] == fast.logprobs  # the same float, not just close
    assert general.top_logprobs is not None
    assert [top[0][1] for top in general.top_logprobs[:-1]] == fast.logprobs  # (topk's order among ties is its own)


def test_a_mixed_batch_gives_each_row_what_it_gets_alone() -> None:
    logits = _logits(rows=6, vocab=60)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.5, seed=11, num_logprobs=2),
        SamplingParams(num_logprobs=4),
        SamplingParams(temperature=0.8, top_k=10, seed=12),
        SamplingParams(),
        SamplingParams(temperature=2.0, top_p=0.9, seed=13, num_logprobs=1),
    ]
    batch = sample(logits, params, list(range(len(params))))
    assert batch.top_logprobs is not None
    for i, p in enumerate(params):
        alone = sample(logits[i : i + 1], [p], [i])
        assert batch.token_ids[i] == alone.token_ids[0]
        assert batch.logprobs[i] == pytest.approx(alone.logprobs[0], abs=1e-6)
        alone_top = alone.top_logprobs[0] if alone.top_logprobs is not None else ()
        assert len(batch.top_logprobs[i]) == len(alone_top) == p.num_logprobs
        for (tok, lp), (alone_tok, alone_lp) in zip(batch.top_logprobs[i], alone_top, strict=True):
            assert tok == alone_tok and lp == pytest.approx(alone_lp, abs=1e-6)


def test_sample_rows_names_a_mismatch() -> None:
    with pytest.raises(InvalidArgumentError):
        sample_rows(_logits(), [1], [], [])
