"""The sampler's argmax and log-normaliser kernel (gpu_worker.model.backends.cpu.logit_stats): each row's first
maximal index and logsumexp equal torch's, at a small and a real (100,352) vocabulary, on rows a stride
apart, with ties, a row masked out entirely and a NaN; the sampler built on it gives plain rows torch's
argmax and log_softmax, and rows the controls write into the raw distribution's log-probabilities; given a
compiled program's stats, the sampler gives what it gives on its own."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker.model.backends.cpu import logit_stats
from gpu_worker.runner.sampling import SamplingParams, sample_rows


@pytest.fixture(scope="module")
def kernel() -> None:
    if not logit_stats.load():
        pytest.skip("no C compiler builds the kernel here")


@pytest.mark.parametrize("vocab", [7, 512, 100_352])
def test_the_kernel_equals_torchs_argmax_and_logsumexp(kernel: None, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(5, vocab + 3, generator=g) * 4  # rows a stride apart, not contiguous as a whole
    logits = wide[:, :vocab]
    logits[1, vocab // 3] = logits[1, 2 * vocab // 3] = logits[1].max() + 1  # a tie: the first one wins
    argmax, lse = logit_stats.stats(logits)
    assert argmax.tolist() == logits.argmax(dim=-1).tolist()
    assert argmax[1].item() == vocab // 3
    torch.testing.assert_close(lse, torch.logsumexp(logits.double(), dim=-1).float(), rtol=0, atol=2e-6 * 16)


def test_a_row_masked_out_and_a_nan(kernel: None) -> None:
    logits = torch.randn(3, 64)
    logits[0] = -math.inf
    logits[2, 5] = math.nan
    argmax, lse = logit_stats.stats(logits)
    assert argmax[0].item() == 0 and lse[0].item() == -math.inf
    assert argmax[2].item() != 5  # a NaN is never the maximum
    assert argmax[1].item() == logits[1].argmax().item()


def test_other_tensors_take_torch(kernel: None) -> None:
    logits = torch.randn(4, 33, dtype=torch.float64)
    argmax, lse = logit_stats.stats(logits)
    assert argmax.tolist() == logits.argmax(dim=-1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1).float())


@pytest.mark.parametrize("vocab", [512, 100_352])
def test_the_sampler_gives_raw_log_probabilities(kernel: None, vocab: int) -> None:
    """Plain rows: the argmax and its log_softmax; a row with a logit bias: the biased choice, scored under
    the raw distribution, as before the kernel."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, vocab, generator=g) * 3
    reference = logits.log_softmax(dim=-1)
    target = int(logits[2].argmin())
    biased = SamplingParams(logit_bias=((target, 100.0),), num_logprobs=3)
    out = sample_rows(logits.clone(), [2], [biased], [0])
    assert out.token_ids[2] == target
    expected = reference.argmax(dim=-1).tolist()
    assert [t for i, t in enumerate(out.token_ids) if i != 2] == [t for i, t in enumerate(expected) if i != 2]
    chosen = torch.tensor(out.token_ids)
    torch.testing.assert_close(torch.tensor(out.logprobs), reference.gather(1, chosen[:, None]).view(-1),
                               rtol=0, atol=1e-5)  # fmt: skip
    assert out.top_logprobs is not None
    top_vals, top_ids = reference[2].topk(3)
    assert [t for t, _ in out.top_logprobs[2]] == top_ids.tolist()
    torch.testing.assert_close(torch.tensor([v for _, v in out.top_logprobs[2]]), top_vals, rtol=0, atol=1e-5)


def test_the_sampler_reads_a_programs_stats_as_its_own(kernel: None) -> None:
    """A compiled decode program hands the sampler each row's argmax and log-normaliser (ForwardOutput.stats):
    the tokens, log-probabilities and alternatives are those it computes itself, plain and controlled rows alike."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 512, generator=g) * 3
    rows, params = [1, 3], [SamplingParams(num_logprobs=2), SamplingParams(logit_bias=((7, 50.0),))]
    own = sample_rows(logits.clone(), rows, params, [0, 0])
    given = sample_rows(logits.clone(), rows, params, [0, 0], stats=logit_stats.stats(logits))
    assert given.token_ids == own.token_ids and given.logprobs == own.logprobs
    assert given.top_logprobs == own.top_logprobs and given.token_ids[3] == 7
