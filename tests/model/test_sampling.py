"""Sampling: greedy, temperature/top-k/top-p, per-request seeded generators, logprobs."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.sampling import SamplingParams, make_generator, sample
from hybridserve.errors import InvalidArgumentError

CPU = torch.device("cpu")


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_logprobs() -> None:
    logits = _logits()
    out = sample(logits, [SamplingParams(num_logprobs=3)] * 4, [None] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, t].item(), abs=1e-5)
        top = out.top_logprobs[i]
        assert [tok for tok, _ in top] == ref[i].topk(3).indices.tolist()
        assert top[0][1] == pytest.approx(out.logprobs[i], abs=1e-6)


def test_seeded_requests_are_reproducible_regardless_of_batch_mates() -> None:
    logits = _logits(rows=3)
    p = SamplingParams(temperature=1.3, seed=42)
    alone = [sample(logits[:1], [p], [make_generator(p, CPU)]).token_ids[0] for _ in range(2)]
    assert alone[0] == alone[1]
    gen = make_generator(p, CPU)
    draws_alone = [sample(logits[:1], [p], [gen]).token_ids[0] for _ in range(20)]
    gen = make_generator(p, CPU)
    mates = [SamplingParams(temperature=0.7), SamplingParams()]
    draws_batched = [sample(logits, [p, *mates], [gen, None, None]).token_ids[0] for _ in range(20)]
    assert draws_alone == draws_batched
    assert len(set(draws_alone)) > 1, "temperature 1.3 over 50 tokens should not be deterministic"


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits()
    greedy = logits.argmax(-1).tolist()
    for p in (SamplingParams(temperature=2.0, top_k=1, seed=1), SamplingParams(temperature=2.0, top_p=1e-6, seed=1)):
        assert sample(logits, [p] * 4, [make_generator(p, CPU) for _ in range(4)]).token_ids == greedy


def test_top_k_restricts_support() -> None:
    logits = _logits(rows=1, vocab=30)
    allowed = set(logits[0].topk(5).indices.tolist())
    p = SamplingParams(temperature=5.0, top_k=5, seed=3)
    gen = make_generator(p, CPU)
    seen = {sample(logits, [p], [gen]).token_ids[0] for _ in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_the_smallest_covering_set() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=0)
    gen = make_generator(p, CPU)
    seen = {sample(logits, [p], [gen]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}


def test_sampled_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    p = SamplingParams(temperature=1.0, seed=7)
    gen = make_generator(p, CPU)
    counts = torch.zeros(3)
    for _ in range(2000):
        counts[sample(torch.log(probs)[None], [p], [gen]).token_ids[0]] += 1
    assert torch.allclose(counts / 2000, probs, atol=0.04)


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"num_logprobs": -2}]
)
def test_invalid_params_are_rejected(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)
