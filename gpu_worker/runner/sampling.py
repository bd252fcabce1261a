"""Token sampling, where the logits are: in the process (or on the device) that ran the forward.

A step's sampling is `sample_step(logits, batch, sampling, history, bitmask)`: one token for each row that
yields (`StepSampling.rows`), as a logits-processor pipeline (`PIPELINE`, vLLM's order; the processors are in
gpu_worker.runner.logits_processors): a grammar's token mask first (below), then the per-request controls
(logit_bias, the min_tokens mask, repetition_penalty, presence and frequency penalties: `apply_controls`),
then temperature, min-p, top-k and top-p, then the draw; greedy rows (temperature 0) take the argmax of
the masked and controlled logits. Rows that need nothing but the argmax and its log-probability
(`SamplingParams.is_plain`) cost no Python of their own, and a step without controls runs none of
`apply_controls`. The controls run once per step over the rows
that have them, as tensors (scatters for the bias and the mask, a gather and a scatter at the tokens each
row has seen for the penalties), never per token in Python. Log-probabilities are those of the model's
raw distribution (log_softmax of the unmodified logits), for the chosen token and the top-n alternatives.

The penalties and min_tokens read per-request state that outlives a step (gpu_worker.runner.history).

Seeded draws take a counter-based random stream keyed by (seed, position) (gpu_worker.runner.random_stream);
unseeded requests draw from the process's global generator.

Structured outputs add one step before the pipeline: a row a grammar constrains comes with its token mask
(gpu_worker.runner.token_masks: built by the engine's matcher while the forward ran), and the tokens it
disallows go to -inf, for greedy and sampled rows alike, with the same tokens as masking before
everything: a row with min-p, top-k or top-p is masked before its filters; any other row chooses first
and is masked (and chooses again, with the same random draw) only when its choice is one its mask
disallows. Log-probabilities stay those of the raw distribution. A step without constrained rows pays
nothing for it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gpu_worker.model.backends.cpu import logit_stats
from gpu_worker.runner.batch import Batch
from gpu_worker.runner.logits_processors import apply_controls, choose_masked, filter_logits, has_filters
from gpu_worker.runner.random_stream import STREAMS
from gpu_worker.runner.token_masks import TokenMasks, mask_rows_, outside_masks
from hybridserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from gpu_worker.runner.history import HistoryTables, TokenHistory
    from gpu_worker.runner.speculation import Verified

MAX_LOGIT_BIAS_TOKENS = 1024  # logit_bias entries one request may have (the step tables' width)
MAX_HELD_TOKENS = 80  # held_token_ids: stop_token_ids (at most 64, admission) and the EOS ids


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings (mirrors the public `SamplingParams` message)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request generator seed; None = global RNG
    num_logprobs: int = 0  # top-n alternatives to return per token (0 = none)
    # Per-request controls (vLLM's names and semantics); the defaults are off.
    presence_penalty: float = 0.0  # subtracted once from a token generated before (OpenAI's)
    frequency_penalty: float = 0.0  # subtracted per time a token was generated before (OpenAI's)
    repetition_penalty: float = 1.0  # transformers': over prompt and generated tokens; 1 = off
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the best (after temperature)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the raw logits
    min_tokens: int = 0  # held_token_ids are masked until this many tokens were generated
    held_token_ids: tuple[int, ...] = ()  # what min_tokens holds off: EOS and stop_token_ids
    # Greedy without alternatives: the batch's argmax and log-normaliser serve the row, no Python of its own.
    is_plain: bool = field(init=False, repr=False, compare=False)
    # Any control above is on: the row goes through apply_controls.
    has_controls: bool = field(init=False, repr=False, compare=False)
    # The controls read the request's token history (HistoryTables): penalties or min_tokens.
    needs_history: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.num_logprobs < 0:
            raise InvalidArgumentError(f"logprobs must be >= 0, got {self.num_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidArgumentError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise InvalidArgumentError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidArgumentError(f"min_p must be in [0, 1], got {self.min_p}")
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidArgumentError(f"logit_bias of token {token} must be in [-100, 100], got {bias}")
        if self.min_tokens < 0:
            raise InvalidArgumentError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidArgumentError(
                f"logit_bias holds {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS}"
            )
        if len(self.held_token_ids) > MAX_HELD_TOKENS:
            raise InvalidArgumentError(f"{len(self.held_token_ids)} stop token ids; at most {MAX_HELD_TOKENS}")
        history = (
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
            or (self.min_tokens > 0 and bool(self.held_token_ids))
        )  # fmt: skip
        controls = history or bool(self.logit_bias) or self.min_p > 0.0
        object.__setattr__(self, "needs_history", history)
        object.__setattr__(self, "has_controls", controls)
        object.__setattr__(self, "is_plain", self.temperature == 0.0 and self.num_logprobs == 0 and not controls)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


TopLogprobs = tuple[tuple[int, float], ...]  # (token_id, logprob), best first


@dataclass(frozen=True, slots=True)
class StepSampling:
    """What a step samples: one token for each of `rows` (batch rows, ascending: the rows whose chunk
    reaches the end of their request's known tokens). `special` (ascending indices into `rows`) are the
    rows that need more than the argmax, with their `params`, one each; every other row is plain greedy.
    `histories`, when not empty, has one entry per special row: the request's tokens for those whose params
    need_history (None for the others); only the process that writes the HistoryTables reads it.
    `masked` (ascending indices into `rows`) are the rows a grammar constrains, whose masks `masks` fills."""

    rows: Sequence[int] = ()
    special: Sequence[int] = ()
    params: Sequence[SamplingParams] = ()
    masked: Sequence[int] = ()
    masks: TokenMasks | None = None
    histories: Sequence[TokenHistory | None] = ()

    def __post_init__(self) -> None:
        if len(self.special) != len(self.params):
            raise InvalidArgumentError(f"sampling: {len(self.special)} special rows, {len(self.params)} params")
        if self.histories and len(self.histories) != len(self.special):
            raise InvalidArgumentError(f"sampling: {len(self.special)} special rows, {len(self.histories)} histories")
        if bool(self.masked) != (self.masks is not None):
            raise InvalidArgumentError(f"sampling: {len(self.masked)} masked rows, masks {self.masks!r}")

    @classmethod
    def of(
        cls, rows: Sequence[int], params: Sequence[SamplingParams], histories: Sequence[TokenHistory] | None = None
    ) -> StepSampling:
        """From every row's params (tests and tools; the engine builds it without looking at plain rows);
        `histories`: every row's tokens, when some row's params need them."""
        special = [j for j, p in enumerate(params) if not p.is_plain]
        hist = tuple(histories[j] if params[j].needs_history else None for j in special) if histories else ()
        return cls(tuple(rows), tuple(special), tuple(params[j] for j in special), histories=hist)


# (batch row, log-probabilities): a scored row's prompt tokens after its chunk's first (SequenceChunk.score)
PromptScores = tuple[tuple[int, list[float]], ...]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One sampled token per yielding row (`StepSampling.rows`), in that order."""

    token_ids: list[int]
    logprobs: list[float]  # log-probability of each chosen token
    top_logprobs: list[TopLogprobs] | None  # per row: num_logprobs alternatives; None when no row asks
    prompt_scores: PromptScores = ()  # the scored rows' prompt log-probabilities (ForwardOutput.prompt_scores)
    # the drafted rows' verifications (gpu_worker.runner.speculation): their accepted drafts come before
    # their token here
    drafts: tuple[Verified, ...] = ()
    # multi-token prediction (gpu_worker.runner.mtp): (batch row, drafts) of each row that asked for them
    # (SequenceChunk.mtp_drafts > 0): the tokens the MTP head proposes after the row's token of this step
    proposals: tuple[tuple[int, tuple[int, ...]], ...] = ()


EMPTY_OUTPUT = StepOutput([], [], None)


def sample_positions(batch: Batch, sampling: StepSampling) -> list[int]:
    """The position of the token each special row samples (the random stream's counter)."""
    seqs, rows = batch.sequences, sampling.rows
    return [seqs[rows[j]].start_pos + len(seqs[rows[j]].token_ids) for j in sampling.special]


def sample_step(
    last_logits: torch.Tensor,
    batch: Batch,
    sampling: StepSampling,
    history: HistoryTables | None = None,
    bitmask: torch.Tensor | None = None,
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> StepOutput:
    """`sampling`'s tokens from `last_logits` [num_sequences, vocab]: the logits after each batch row's last
    token (the runner's forward output; the controlled rows are overwritten: sample_rows). `history` holds
    the state of the rows whose params need_history (written for this step already). `bitmask`
    [len(sampling.masked), words] int32: the masked rows' token masks, filled (required when
    `sampling.masked` is not empty). `stats`: every row's first maximal token and log-normaliser where the
    forward computed them (ForwardOutput.stats: a compiled decode program)."""
    if not sampling.rows:
        return EMPTY_OUTPUT
    rows = sampling.rows
    every = len(rows) == last_logits.shape[0]
    logits = last_logits if every else last_logits[list(rows)]  # all rows: no copy
    if stats is not None and not every:
        stats = (stats[0][list(rows)], stats[1][list(rows)])
    if sampling.masked and bitmask is None:
        raise InvalidArgumentError(f"sample_step: {len(sampling.masked)} masked rows and no bitmask")
    seqs = batch.sequences
    slots = [seqs[rows[j]].state_slot for j in sampling.special]
    positions = sample_positions(batch, sampling)
    return sample_rows(
        logits, sampling.special, sampling.params, positions, sampling.masked, bitmask, slots=slots, history=history,
        stats=stats,
    )  # fmt: skip


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> StepOutput:
    """Pick one token per row of `logits` [b, vocab] (float32); `params`/`positions` are per row (no row may
    need_history: that state lives in a runner's HistoryTables)."""
    if len(params) != logits.shape[0] or len(positions) != logits.shape[0]:
        raise InvalidArgumentError(f"sample: {logits.shape[0]} rows, {len(params)} params, {len(positions)} positions")
    rows = [i for i, p in enumerate(params) if not p.is_plain]
    return sample_rows(logits, rows, [params[i] for i in rows], [positions[i] for i in rows])


@torch.inference_mode()  # the forward's logits are inference tensors, which the controls write into
def sample_rows(
    logits: torch.Tensor,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    masked_rows: Sequence[int] = (),
    bitmask: torch.Tensor | None = None,
    *,
    slots: Sequence[int] = (),
    history: HistoryTables | None = None,
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> StepOutput:
    """`sample` where only `rows` (ascending) need more than the argmax: `params`/`positions` are theirs,
    one each (a position keys a seeded row's random stream; `slots`, their state slots, key `history` for
    the rows whose params need_history); every other row is greedy without alternatives
    (SamplingParams.is_plain). `masked_rows` (ascending) are constrained by `bitmask`'s rows, one each
    (mask_rows_), whatever else they need: a row with filters (min-p, top-k, top-p) is masked before
    them; any other masked row is masked only when its unmasked choice falls outside its mask (the
    choice is then the same as masked first: see below), which spares most steps of a trained model's
    constrained rows the full-vocabulary mask.

    The rows in no list cost no Python: a batch of plain rows is one kernel (each row's first maximum and
    log-normaliser: gpu_worker.model.backends.cpu.logit_stats), one gather and two tolists. Same tokens and
    log-probabilities as row by row. The masks and the controls (apply_controls) write into their rows of
    `logits` (a float32 tensor is not copied): the log-probabilities are of the raw logits (the rows
    written are copied first). `stats`, every row's first maximal token and log-normaliser of `logits` where
    a compiled decode program has them already (the same kernel), spares that kernel here."""
    if len(params) != len(rows) or len(positions) != len(rows):
        raise InvalidArgumentError(f"sample_rows: {len(rows)} rows, {len(params)} params, {len(positions)} positions")
    logits = logits.float()
    # [b] each, of the raw logits: one kernel over every row, unless the forward's program ran it (`stats`)
    first_max, lse = stats if stats is not None else logit_stats.stats(logits)
    top = _alternatives(logits, rows, params, lse)  # of the raw logits, before anything below writes into them
    work = logits  # the logits the tokens are chosen from (written in place from here on)
    check: list[int] = []  # indices into masked_rows whose choice is checked against the mask after it
    words: np.ndarray[Any, Any] = np.empty((0, 0), np.int32)
    first: list[int] = []  # indices into masked_rows masked before everything
    if masked_rows:  # the mask step: first, before every control, filter and the argmax (see below)
        assert bitmask is not None and bitmask.shape[0] == len(masked_rows)
        words = bitmask.to("cpu", torch.int32).numpy()  # [masked, words]: the bit tests and the sparse choices
        param_of = dict(zip(rows, params, strict=True))
        filtered = [r in param_of and has_filters(param_of[r], logits.shape[-1]) for r in masked_rows]
        first = [j for j, f in enumerate(filtered) if f]
        check = [j for j, f in enumerate(filtered) if not f]
    controlled = [j for j, p in enumerate(params) if p.has_controls]
    written = sorted({masked_rows[j] for j in first} | {rows[j] for j in controlled})  # rows written in place
    raw = logits[written] if written else None  # their raw logits (a copy), for the chosen log-probabilities
    if first:
        mask_rows_(work, [masked_rows[j] for j in first], bitmask[first])  # type: ignore[index]
    if controlled:  # the controls write into their rows of `work`, in place
        _control(work, rows, params, controlled, slots, history)
    chosen = first_max.to(logits.device)  # [b]; the first maximal logit
    if written:
        chosen[written] = work[written].argmax(dim=-1)
    random = [(i, p, pos) for i, p, pos in zip(rows, params, positions, strict=True) if p.temperature != 0.0]
    noise = _draw(work, random, chosen) if random else torch.empty(0)
    if check:
        _choose_again_masked(work, chosen, [masked_rows[j] for j in check], words[check], random, noise)
    chosen_logit = logits.gather(1, chosen[:, None]).view(-1)
    if raw is not None:
        chosen_logit[written] = raw.gather(1, chosen[written][:, None]).view(-1)
    chosen_lp = chosen_logit - lse.to(logits.device)
    return StepOutput(token_ids=chosen.tolist(), logprobs=chosen_lp.tolist(), top_logprobs=top)


def _alternatives(
    logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams], lse: torch.Tensor
) -> list[TopLogprobs] | None:
    """Each row's top num_logprobs alternatives of the raw `logits` (every other row's empty); None when no
    row asks for any."""
    max_n = max([p.num_logprobs for p in params], default=0)
    if not max_n:
        return None
    vals, idx = logits[list(rows)].topk(min(max_n, logits.shape[-1]), dim=-1)
    vals_l, idx_l = (vals - lse[list(rows), None]).tolist(), idx.tolist()
    top: list[TopLogprobs] = [()] * logits.shape[0]
    for j, (i, p) in enumerate(zip(rows, params, strict=True)):
        top[i] = tuple(zip(idx_l[j][: p.num_logprobs], vals_l[j][: p.num_logprobs], strict=True))
    return top


def _control(
    work: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams], controlled: Sequence[int],
    slots: Sequence[int], history: HistoryTables | None,
) -> None:  # fmt: skip
    """The controls of `controlled` (indices into `rows`) on `work`, in place, with the history of those that
    need it (read at their `slots`)."""
    with_history = [j for j in controlled if params[j].needs_history]
    state = None
    if with_history:
        if history is None or len(slots) != len(rows):
            raise InvalidArgumentError("sample_rows: penalties or min_tokens without the rows' history")
        state = tuple(t.to(work.device) if isinstance(t, torch.Tensor) else t
                      for t in history.rows([slots[j] for j in with_history]))  # fmt: skip
    apply_controls(work, [rows[j] for j in controlled], [params[j] for j in controlled], state)  # type: ignore[arg-type]


def _draw(work: torch.Tensor, random: Sequence[tuple[int, SamplingParams, int]], chosen: torch.Tensor) -> torch.Tensor:
    """The sampled rows' tokens (`random`: row, params, position) written into `chosen`, from their filtered
    logits in `work`; returns the draws' noise [len(random), vocab], which a masked row's second choice reuses."""
    index = torch.tensor([i for i, _, _ in random], device=work.device)
    probs = filter_logits(work[index], [p for _, p, _ in random]).softmax(dim=-1)
    noise = torch.empty_like(probs)
    if any(p.seed is None for _, p, _ in random):
        noise.exponential_()  # the unseeded rows' draws, from this process's generator, in one call
    for j, (_, p, pos) in enumerate(random):
        if p.seed is not None:
            noise[j].exponential_(generator=STREAMS.at(work.device, p.seed, pos))
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
    chosen[index] = (probs / noise).argmax(dim=-1)
    return noise


def _choose_again_masked(
    work: torch.Tensor, chosen: torch.Tensor, masked: Sequence[int], words: np.ndarray[Any, Any],
    random: Sequence[tuple[int, SamplingParams, int]], noise: torch.Tensor,
) -> None:  # fmt: skip
    """The rows `masked` (their masks `words`, no filters) chose from their unmasked logits: when the token
    is one its mask allows, it is the masked choice too (the first maximum among all tokens is the first
    among the allowed ones; the race's winner over all tokens wins over the allowed ones, with the same
    noise, as a row's normalisation does not change its argmax). The others choose again, masked."""
    outside = outside_masks(chosen, masked, words)
    redo = [j for j, out in enumerate(outside) if out]
    if not redo:
        return
    drawn = {i: (k, p) for k, (i, p, _) in enumerate(random)}
    for j in redo:
        row = masked[j]
        chosen[row] = choose_masked(work[row], words[j], drawn.get(row), noise)
