"""Greedy generation through the runner (all requests batched per step) equals transformers generate()."""

from __future__ import annotations

import torch

from gpu_worker.runner.batch import Batch
from gpu_worker.runner.sampling import SamplingParams, sample
from tests.model.model_helpers import Request, make_runner

NEW_TOKENS = 64


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_greedy_64_tokens_match_generate(checkpoint) -> None:
    hf, path = checkpoint
    runner = make_runner(path, page_size=4)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 23, 12)]
    reqs = [Request(runner, p) for p in prompts]
    params, positions = [SamplingParams()] * len(reqs), [0] * len(reqs)
    # prefill: first prompt in two chunks, others whole, all packed together in the second step
    runner.forward(Batch((reqs[0].chunk(3),)))
    logits = runner.forward(Batch((reqs[0].chunk(2), reqs[1].chunk(23), reqs[2].chunk(12)))).logits
    for _ in range(NEW_TOKENS):
        next_ids = sample(logits, params, positions).token_ids
        for r, t in zip(reqs, next_ids, strict=True):
            r.token_ids.append(t)
        logits = runner.forward(Batch(tuple(r.chunk(1) for r in reqs))).logits
    for r, p in zip(reqs, prompts, strict=True):
        assert r.token_ids[len(p) :] == _hf_greedy(hf, p)
