"""Token sampling over a batch of last-position logits.

Greedy rows (temperature 0) take the argmax; the rest go through temperature, top-k, then top-p, and draw
with their own `torch.Generator` when the request has a seed (reproducible regardless of batch mates), or
from the global RNG otherwise. Log-probabilities are those of the model's raw distribution
(log_softmax of the unmodified logits), for the chosen token and the top-n alternatives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridserve.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings (mirrors the public `SamplingParams` message)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request generator seed; None = global RNG
    num_logprobs: int = 0  # top-n alternatives to return per token (0 = none)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.num_logprobs < 0:
            raise InvalidArgumentError(f"logprobs must be >= 0, got {self.num_logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """One sampled token per row, in row order."""

    token_ids: list[int]
    logprobs: list[float]  # log-probability of each chosen token
    top_logprobs: list[list[tuple[int, float]]]  # per row: num_logprobs (token_id, logprob), best first


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's generator (create once per request, keep it for the request's lifetime)."""
    if params.seed is None or params.is_greedy:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def _filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k and top-p on rows [b, vocab] -> logits with excluded tokens at -inf."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
    logits = logits / temps[:, None]
    vocab = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    if all(k == vocab for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)[None, :]
    drop = rank >= torch.tensor(top_ks, device=device)[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    drop |= mass_before >= torch.tensor(top_ps, device=device, dtype=torch.float32)[:, None]
    drop[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> SampleOutput:
    """Pick one token per row of `logits` [b, vocab] (float32). `params`/`generators` are per row."""
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise InvalidArgumentError(
            f"sample: {logits.shape[0]} rows, {len(params)} params, {len(generators)} generators"
        )
    logits = logits.float()
    chosen = logits.argmax(dim=-1)  # [b]
    random_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]  # not p.is_greedy, inlined
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filter_logits(logits[rows], [params[i] for i in random_rows]).softmax(dim=-1)
        for j, i in enumerate(random_rows):
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one generator call per row.
            noise = torch.empty_like(probs[j]).exponential_(generator=generators[i])
            chosen[i] = (probs[j] / noise).argmax()
    log_z = torch.logsumexp(logits, dim=-1)  # [b]
    chosen_lp = logits.gather(1, chosen[:, None])[:, 0] - log_z
    max_n = max(p.num_logprobs for p in params) if params else 0
    top: list[list[tuple[int, float]]] = [[]] * len(params) if not max_n else []  # shared empty rows, never mutated
    if max_n:
        vals, idx = logits.topk(min(max_n, logits.shape[-1]), dim=-1)
        vals = vals - log_z[:, None]
        vals_l, idx_l = vals.tolist(), idx.tolist()
        top = [list(zip(idx_l[i], vals_l[i], strict=True))[: p.num_logprobs] for i, p in enumerate(params)]
    return SampleOutput(token_ids=chosen.tolist(), logprobs=chosen_lp.tolist(), top_logprobs=top)
