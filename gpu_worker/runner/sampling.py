"""Token sampling, where the logits are: in the process (or on the device) that ran the forward.

A step's sampling is `sample_step(logits, batch, sampling)`: one token for each row that yields
(`StepSampling.rows`), as a logits-processor pipeline (`PIPELINE`): temperature, then top-k, then top-p,
then the draw; greedy rows (temperature 0) take the argmax. Rows that need nothing but the argmax and its
log-probability (`SamplingParams.is_plain`) cost no Python of their own. Log-probabilities are those of the
model's raw distribution (log_softmax of the unmodified logits), for the chosen token and the top-n
alternatives.

The random stream is counter-based: a seeded request's draw for the token at position p (the number of
tokens before it, prompt included) uses a generator seeded with `stream_key(seed, p)`, so a request
samples the same tokens whatever process, batch or step it lands in, and after a preemption. Unseeded
requests draw from the process's global generator.

Structured outputs add one step before the pipeline: a row a grammar constrains comes with its token mask
(one bit per token id, vocab/32 int32 words, built by the engine's matcher while the forward ran:
`TokenMasks`), and `apply_token_masks` puts the tokens it disallows at -inf before the argmax and the
filters, for greedy and sampled rows alike. Log-probabilities stay those of the raw distribution. A step
without constrained rows pays nothing for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from gpu_worker.runner.batch import Batch
from hybridserve.errors import InvalidArgumentError

_MASK64 = (1 << 64) - 1


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


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at `position`: a function of (seed, position) alone."""
    return _splitmix64((seed & _MASK64) ^ _splitmix64(position))


class _Streams:
    """One reusable generator per device, reseeded for each seeded draw (building one costs more)."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def at(self, device: torch.device, seed: int, position: int) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator.manual_seed(stream_key(seed, position))


_STREAMS = _Streams()


def mask_vocab_size(logits_vocab: int, tokenizer_vocab: int) -> int:
    """The token ids a mask covers: the logits' width, or the tokenizer's where that is larger."""
    return max(logits_vocab, tokenizer_vocab)


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token mask (bit t % 32 of word t // 32: token t allowed)."""
    return (vocab_size + 31) // 32


class TokenMasks(Protocol):
    """The token masks of a step's constrained rows (StepSampling.masked), built by whoever owns the
    matchers (the engine: gpu_worker.engine.grammar.StepMasks). The runner calls `fill` once, while the
    forward runs, and waits for it before sampling."""

    words: int  # int32 words per row

    def fill(self, bitmask: np.ndarray[Any, Any], indices: Sequence[int]) -> None:
        """Writes constrained row j's mask into row `indices[j]` of `bitmask` (int32 [n, words])."""
        ...


@dataclass(frozen=True, slots=True)
class StepSampling:
    """What a step samples: one token for each of `rows` (batch rows, ascending: the rows whose chunk
    reaches the end of their request's known tokens). `special` (ascending indices into `rows`) are the
    rows that need more than the argmax, with their `params`, one each; every other row is plain greedy.
    `masked` (ascending indices into `rows`) are the rows a grammar constrains, whose masks `masks` fills."""

    rows: Sequence[int] = ()
    special: Sequence[int] = ()
    params: Sequence[SamplingParams] = ()
    masked: Sequence[int] = ()
    masks: TokenMasks | None = None

    def __post_init__(self) -> None:
        if len(self.special) != len(self.params):
            raise InvalidArgumentError(f"sampling: {len(self.special)} special rows, {len(self.params)} params")
        if bool(self.masked) != (self.masks is not None):
            raise InvalidArgumentError(f"sampling: {len(self.masked)} masked rows, masks {self.masks!r}")

    @classmethod
    def of(cls, rows: Sequence[int], params: Sequence[SamplingParams]) -> StepSampling:
        """From every row's params (tests and tools; the engine builds it without looking at plain rows)."""
        special = [j for j, p in enumerate(params) if not p.is_plain]
        return cls(tuple(rows), tuple(special), tuple(params[j] for j in special))


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One sampled token per yielding row (`StepSampling.rows`), in that order."""

    token_ids: list[int]
    logprobs: list[float]  # log-probability of each chosen token
    top_logprobs: list[TopLogprobs] | None  # per row: num_logprobs alternatives; None when no row asks


EMPTY_OUTPUT = StepOutput([], [], None)


def sample_positions(batch: Batch, sampling: StepSampling) -> list[int]:
    """The position of the token each special row samples (the random stream's counter)."""
    seqs, rows = batch.sequences, sampling.rows
    return [seqs[rows[j]].start_pos + len(seqs[rows[j]].token_ids) for j in sampling.special]


def sample_step(
    last_logits: torch.Tensor, batch: Batch, sampling: StepSampling, bitmask: torch.Tensor | None = None
) -> StepOutput:
    """`sampling`'s tokens from `last_logits` [num_sequences, vocab]: the logits after each batch row's last
    token (the runner's forward output). `bitmask` [len(sampling.masked), words] int32: the masked rows'
    token masks, filled (required when `sampling.masked` is not empty)."""
    if not sampling.rows:
        return EMPTY_OUTPUT
    rows = sampling.rows
    logits = last_logits if len(rows) == last_logits.shape[0] else last_logits[list(rows)]  # all rows: no copy
    if sampling.masked and bitmask is None:
        raise InvalidArgumentError(f"sample_step: {len(sampling.masked)} masked rows and no bitmask")
    return sample_rows(
        logits, sampling.special, sampling.params, sample_positions(batch, sampling), sampling.masked, bitmask
    )


# Byte -> its 8 bits, least significant first (a mask's byte b holds tokens 8b..8b+7, on a little-endian host).
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1).bool()


def apply_token_masks(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """The mask step, before every other: `logits` [b, vocab] with the tokens that row `rows[j]`'s mask
    (`bitmask[j]`, int32 words, bit t % 32 of word t // 32 set = token t allowed) disallows at -inf.
    A new tensor: the raw logits stay for the log-probabilities. Token ids past the mask are disallowed."""
    vocab = logits.shape[-1]
    table = _BYTE_BITS if _BYTE_BITS.device == logits.device else _BYTE_BITS.to(logits.device)
    as_bytes = bitmask.to(logits.device, torch.int32).contiguous().view(torch.uint8).long()  # [m, words * 4]
    allowed = table[as_bytes].view(len(rows), -1)  # [m, words * 32]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab]
    if len(rows) == logits.shape[0]:  # every row constrained (rows ascending: in order)
        return logits.masked_fill(~allowed, float("-inf"))
    masked = logits.clone()
    index = torch.tensor(list(rows), device=logits.device)
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked


def _filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The pipeline's filters on rows [b, vocab]: temperature, top-k and top-p -> logits with excluded
    tokens at -inf. (Per-request controls and masks join here, before the temperature.)"""
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


PIPELINE = ("temperature", "top_k", "top_p", "draw")  # the order _filter_logits and sample_rows apply them


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> StepOutput:
    """Pick one token per row of `logits` [b, vocab] (float32); `params`/`positions` are per row."""
    if len(params) != logits.shape[0] or len(positions) != logits.shape[0]:
        raise InvalidArgumentError(f"sample: {logits.shape[0]} rows, {len(params)} params, {len(positions)} positions")
    rows = [i for i, p in enumerate(params) if not p.is_plain]
    return sample_rows(logits, rows, [params[i] for i in rows], [positions[i] for i in rows])


def sample_rows(
    logits: torch.Tensor,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    masked_rows: Sequence[int] = (),
    bitmask: torch.Tensor | None = None,
) -> StepOutput:
    """`sample` where only `rows` (ascending) need more than the argmax: `params`/`positions` are theirs,
    one each (a position keys a seeded row's random stream); every other row is greedy without
    alternatives (SamplingParams.is_plain). `masked_rows` (ascending) are constrained by `bitmask`'s rows,
    one each (apply_token_masks), whatever else they need.

    The rows in no list cost no Python: a batch of plain rows is one argmax, one log_softmax, one
    gather and two tolists. Same tokens and log-probabilities as row by row."""
    if len(params) != len(rows) or len(positions) != len(rows):
        raise InvalidArgumentError(f"sample_rows: {len(rows)} rows, {len(params)} params, {len(positions)} positions")
    logits = logits.float()
    choose = logits
    if masked_rows:  # the mask step: first, before every filter and the argmax
        assert bitmask is not None and bitmask.shape[0] == len(masked_rows)
        choose = apply_token_masks(logits, masked_rows, bitmask)
    chosen = choose.argmax(dim=-1)  # [b]; the first maximal logit
    random = [(i, p, pos) for i, p, pos in zip(rows, params, positions, strict=True) if p.temperature != 0.0]
    if random:
        index = torch.tensor([i for i, _, _ in random], device=logits.device)
        probs = _filter_logits(choose[index], [p for _, p, _ in random]).softmax(dim=-1)
        noise = torch.empty_like(probs)
        if any(p.seed is None for _, p, _ in random):
            noise.exponential_()  # the unseeded rows' draws, from this process's generator, in one call
        for j, (_, p, pos) in enumerate(random):
            if p.seed is not None:
                noise[j].exponential_(generator=_STREAMS.at(logits.device, p.seed, pos))
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
        chosen[index] = (probs / noise).argmax(dim=-1)
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
    return StepOutput(token_ids=chosen.tolist(), logprobs=chosen_lp.tolist(), top_logprobs=top)
