"""Token sampling over a batch of last-position logits.

Greedy rows (temperature 0) take the argmax; the rest go through temperature, top-k, then top-p, and draw
with their own `torch.Generator` when the request has a seed (reproducible regardless of batch mates), or
from the global RNG otherwise. Log-probabilities are those of the model's raw distribution
(log_softmax of the unmodified logits), for the chosen token and the top-n alternatives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridserve.errors import InvalidArgumentError

# A seeded request's own random stream, which the engine keeps on the request (engine code names the
# type through this alias, so that only the runner imports torch).
Generator = torch.Generator


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings (mirrors the public `SamplingParams` message)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request generator seed; None = global RNG
    num_logprobs: int = 0  # top-n alternatives to return per token (0 = none)
    # Greedy without alternatives: the batch's argmax and log-normaliser serve the row, no Python of its own.
    is_plain: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.num_logprobs < 0:
            raise InvalidArgumentError(f"logprobs must be >= 0, got {self.num_logprobs}")
        object.__setattr__(self, "is_plain", self.temperature == 0.0 and self.num_logprobs == 0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


TopLogprobs = tuple[tuple[int, float], ...]  # (token_id, logprob), best first


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """One sampled token per row, in row order."""

    token_ids: list[int]
    logprobs: list[float]  # log-probability of each chosen token
    top_logprobs: list[TopLogprobs] | None  # per row: num_logprobs alternatives; None when no row asks


def make_generator(params: SamplingParams, device: torch.device) -> Generator | None:
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
    rows = [i for i, p in enumerate(params) if not p.is_plain]
    return sample_rows(logits, rows, [params[i] for i in rows], [generators[i] for i in rows])


def sample_rows(
    logits: torch.Tensor,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> SampleOutput:
    """`sample` where only `rows` (ascending) need more than the argmax: `params`/`generators` are
    theirs, one each; every other row is greedy without alternatives (SamplingParams.is_plain).

    The rows in no list cost no Python: a batch of plain rows is one argmax, one log_softmax, one
    gather and two tolists. Same tokens and log-probabilities as row by row."""
    if len(params) != len(rows) or len(generators) != len(rows):
        raise InvalidArgumentError(f"sample_rows: {len(rows)} rows, {len(params)} params, {len(generators)} generators")
    logits = logits.float()
    chosen = logits.argmax(dim=-1)  # [b]; the first maximal logit
    random = [(i, p, g) for i, p, g in zip(rows, params, generators, strict=True) if p.temperature != 0.0]
    if random:
        index = torch.tensor([i for i, _, _ in random], device=logits.device)
        probs = _filter_logits(logits[index], [p for _, p, _ in random]).softmax(dim=-1)
        for j, (i, _, generator) in enumerate(random):
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one generator call per row.
            noise = torch.empty_like(probs[j]).exponential_(generator=generator)
            chosen[i] = (probs[j] / noise).argmax()
    logp = logits.log_softmax(dim=-1)  # [b, vocab]: one fused pass (logsumexp is several)
    chosen_lp = logp.gather(1, chosen[:, None]).view(-1)
    max_n = max([p.num_logprobs for p in params], default=0)
    top: list[TopLogprobs] | None = None
    if max_n:
        vals, idx = logp[list(rows)].topk(min(max_n, logits.shape[-1]), dim=-1)
        vals_l, idx_l = vals.tolist(), idx.tolist()
        top = [()] * logits.shape[0]
        for j, (i, p) in enumerate(zip(rows, params, strict=True)):
            top[i] = tuple(zip(idx_l[j][: p.num_logprobs], vals_l[j][: p.num_logprobs], strict=True))
    return SampleOutput(token_ids=chosen.tolist(), logprobs=chosen_lp.tolist(), top_logprobs=top)
