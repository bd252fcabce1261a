"""Speculative steps, runner side: a decode row may carry draft tokens (SequenceChunk.num_draft_tokens),
proposed by the engine (gpu_worker.engine.speculation). One forward scores them all, the sampler checks
them, and the row keeps exactly what a plain decode of the accepted tokens would have left.

A row [t, d_1 .. d_k] (t the newest output token, not computed yet; d_i the drafts) is one chunk of
1 + k tokens through the packed forward, with the logits at each of its positions: the logits after t
predict d_1, after d_i predict d_{i+1}, after d_k the token past the drafts.

Verification (`verify_drafts`). The sampler draws the token x_i at every position i of the chunk, each
with the row's own params and, for a seeded row, the random stream of its position (the position x_i
would have in a plain decode: start_pos + i + 1). The row accepts the longest prefix of drafts with
d_{i+1} = x_i and emits d_1 .. d_j, x_j: greedy rows take the model's argmax at every position, and a
sampled row draws each token from its target distribution exactly as it would without drafts (rejection
sampling with a point-mass draft accepts d with probability p(d) and otherwise draws from p with d taken
out: the same law as drawing x from p and accepting when x = d). So the output is that of speculation
off, token for token for greedy and seeded rows, in distribution for the others.

State. The Mamba state and conv window after each draft position are kept during the forward, as the
prefix cache keeps block-boundary states inside a prefill chunk: boundary states at offsets 1 .. k of
the chunk, written to the state pool's draft rows (MambaStatePool.draft_row), assigned per step in
batch order (`with_draft_rows`). After verification `roll_back` copies the state after the last
accepted token (offset 1 + j) into the row's slot; with every draft accepted the slot already holds
it. The KV written at rejected positions lies past the request's computed tokens: no attention reads
it before a later step writes those positions again. Kept states rather than a second forward from the
last accepted token: the copy is one row per layer, a recompute is a whole forward of the row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from gpu_worker.model.backends.cpu.short_scan import SHORT_SPAN_TOKENS
from gpu_worker.runner.batch import Batch, ForwardOutput
from gpu_worker.runner.sampling import SamplingParams, StepOutput, StepSampling, TopLogprobs, sample_rows
from gpu_worker.runner.state_pool import MambaStatePool

if TYPE_CHECKING:
    from gpu_worker.runner.history import HistoryTables
from hybridserve.errors import InvalidArgumentError

_GREEDY = SamplingParams()


class Verified(NamedTuple):
    """One drafted row's verification: the drafts it accepted (tokens, log-probabilities, alternatives),
    ahead of its StepOutput token (the model's own token after them)."""

    row: int  # batch row
    num_drafted: int
    token_ids: tuple[int, ...]  # the accepted drafts, in order
    logprobs: tuple[float, ...]
    top_logprobs: tuple[TopLogprobs, ...]  # per accepted draft; () entries when the row asks none


def drafted_rows(batch: Batch) -> list[int]:
    """The batch rows that carry drafts."""
    return [i for i, s in enumerate(batch.sequences) if s.num_draft_tokens]


def check_drafted(batch: Batch) -> None:
    """Raises InvalidArgumentError unless every drafted row is a decode chunk: its newest token and the
    drafts, on no block boundary (no checkpoint is taken in a verify row)."""
    for i, seq in enumerate(batch.sequences):
        k = seq.num_draft_tokens
        if k and (k < 0 or k >= len(seq.token_ids) or seq.boundary_checkpoints or seq.save_checkpoint_id is not None):
            raise InvalidArgumentError(
                f"batch: row {i} has {k} draft tokens in a chunk of {len(seq.token_ids)} with checkpoints; a drafted"
                " chunk is a decode's newest token and its drafts, on no block boundary"
            )


def keeps_short_spans(batch: Batch, device: torch.device) -> bool:
    """Whether the forward rebuilds a rejected row's state from its short spans' inputs (the CPU mixers
    keep them: gpu_worker.model.backends.cpu.short_scan) rather than keeping every draft position's state
    in the draft rows: on CPU, when every multi-token chunk of the batch is short."""
    return device.type == "cpu" and all(len(s.token_ids) <= SHORT_SPAN_TOKENS for s in batch.sequences)


def with_draft_rows(batch: Batch, state_pool: MambaStatePool) -> Batch:
    """`batch` with each drafted row's states after its draft positions asked for, as boundary states in
    the pool's draft rows (a checkpoint id past the checkpoints is a draft row: build_inputs maps
    checkpoint c to storage row num_slots + c). Raises InvalidArgumentError when the step drafts more
    tokens than the pool has draft rows."""
    seqs = list(batch.sequences)
    first = state_pool.num_checkpoint_slots
    used = 0
    for i, seq in enumerate(seqs):
        k = seq.num_draft_tokens
        if not k:
            continue
        if used + k > state_pool.num_draft_rows:
            raise InvalidArgumentError(
                f"batch: {used + k} draft tokens exceed the state pool's {state_pool.num_draft_rows} draft rows"
            )
        inner = tuple((seq.start_pos + 1 + t, first + used + t) for t in range(k))
        seqs[i] = seq._replace(boundary_checkpoints=inner)
        used += k
    return replace(batch, sequences=tuple(seqs))


def draft_logits(
    hidden: torch.Tensor, token_start: Sequence[int], batch: Batch, logits_of: object
) -> tuple[tuple[int, torch.Tensor], ...]:
    """ForwardOutput.draft_logits: the logits at every position of each drafted row's chunk."""
    out = []
    for i in drafted_rows(batch):
        start, n = token_start[i], len(batch.sequences[i].token_ids)
        out.append((i, logits_of(hidden[start : start + n])))  # type: ignore[operator]
    return tuple(out)


class DraftHistories:
    """The penalties' and min_tokens' history (HistoryTables.rows) at each position of the drafted rows
    that need it: position i of a row [t, d_1 .. d_k] samples after d_1 .. d_i, so its history is the
    slot's (the tokens before t's, and t's, as published for the step) plus those drafts, generated.
    `rows(indices)` answers for stacked position indices, as HistoryTables.rows does for slots."""

    def __init__(self, tables: HistoryTables) -> None:
        self.tables = tables
        self._at: dict[int, tuple[int, tuple[int, ...]]] = {}  # stacked position -> (slot, drafts before it)

    def add(self, index: int, slot: int, before: tuple[int, ...]) -> None:
        self._at[index] = (slot, before)

    def rows(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        per = []
        for index in indices:
            slot, before = self._at[index]
            ids, counts, valid, generated = self.tables.rows([slot])
            seen = ids[0][valid[0]].tolist()
            counted = counts[0][valid[0]].tolist()
            where = {t: c for c, t in enumerate(seen)}
            for token in before:
                column = where.get(token)
                if column is None:
                    column = where[token] = len(seen)
                    seen.append(token)
                    counted.append(0.0)
                counted[column] += 1.0
            per.append((seen, counted, generated[0] + len(before)))
        width = max(1, max(len(seen) for seen, _, _ in per))
        ids_out = torch.zeros(len(per), width, dtype=torch.int64)
        counts_out = torch.zeros(len(per), width, dtype=torch.float32)
        valid_out = torch.zeros(len(per), width, dtype=torch.bool)
        for r, (seen, counted, _) in enumerate(per):
            ids_out[r, : len(seen)] = torch.tensor(seen, dtype=torch.int64)
            counts_out[r, : len(seen)] = torch.tensor(counted)
            valid_out[r, : len(seen)] = True
        return ids_out, counts_out, valid_out, [g for _, _, g in per]


def masked_draft_counts(batch: Batch, sampling: StepSampling) -> list[int]:
    """The drafts each masked row carries, in `sampling.masked` order (token_masks.draft_mask_rows)."""
    seqs, rows = batch.sequences, sampling.rows
    return [seqs[rows[j]].num_draft_tokens for j in sampling.masked]


def verify_drafts(
    out: ForwardOutput, batch: Batch, sampling: StepSampling, sampled: StepOutput, history: HistoryTables | None = None,
    bitmask: torch.Tensor | None = None, before: Sequence[int] = (),
) -> StepOutput:  # fmt: skip
    """`sampled` (the step's tokens, one per yielding row) with each drafted row's token replaced by its
    verification's: the model's token after the accepted drafts, those drafts in `StepOutput.drafts`
    (see the module docstring). One sampler call checks every drafted row's positions; a row whose
    controls read its history (penalties, min_tokens) is checked with the drafts before each position
    counted as generated (`DraftHistories`, over the step's `history` tables); a row a grammar constrains
    (masked row j) with its mask at each position: `bitmask` row j after its chunk, rows `before[j]` + i
    at its draft positions i (TokenMasks.fill), each the grammar's after the drafts ahead of it."""
    if not out.draft_logits:
        return sampled
    index_of = {row: j for j, row in enumerate(sampling.rows)}
    at = _stack_positions(out, batch, sampling, index_of, history, bitmask, before)
    params = at.params
    special = [i for i, p in enumerate(params) if not p.is_plain]
    drawn = sample_rows(
        torch.cat(at.logits),
        special,
        [params[i] for i in special],
        [at.positions[i] for i in special],
        at.masked,
        bitmask[at.mask_rows] if at.masked and bitmask is not None else None,
        slots=special if at.histories is not None else (),
        history=at.histories,  # type: ignore[arg-type]
    )  # every position's token, as a plain decode would draw it there (fmt: skip)
    return _accept(sampled, batch, at.spans, drawn, index_of)


@dataclass(slots=True)
class _Positions:
    """A step's drafted rows' positions, stacked: each position's logits, params and sampled position, the
    rows' spans (batch row, first index into the stacked positions), the drafts' histories where a row's
    controls read them, and the positions a grammar constrains with their rows of the step's bitmask."""

    logits: list[torch.Tensor] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    histories: DraftHistories | None = None
    masked: list[int] = field(default_factory=list)
    mask_rows: list[int] = field(default_factory=list)


def _stack_positions(
    out: ForwardOutput, batch: Batch, sampling: StepSampling, index_of: dict[int, int], history: HistoryTables | None,
    bitmask: torch.Tensor | None, before: Sequence[int],
) -> _Positions:  # fmt: skip
    """Every drafted row's positions, as verify_drafts samples them (one sampler call)."""
    seqs = batch.sequences
    params_of = {sampling.rows[j]: p for j, p in zip(sampling.special, sampling.params, strict=True)}
    masked_of = {sampling.rows[j]: m for m, j in enumerate(sampling.masked)}
    at = _Positions()
    for row, row_logits in out.draft_logits:
        if row not in index_of:
            raise InvalidArgumentError(f"batch: drafted row {row} does not yield a token")
        seq, p = seqs[row], params_of.get(row, _GREEDY)
        n, first = len(seq.token_ids), len(at.positions)
        m = masked_of.get(row)
        if m is not None:
            if bitmask is None or len(before) <= m or before[m] < 0:
                raise InvalidArgumentError(f"batch: drafted row {row} is constrained, and its drafts have no masks")
            at.masked.extend(range(first, first + n))
            at.mask_rows.extend([*range(before[m], before[m] + n - 1), m])
        if p.needs_history:
            if history is None:
                raise InvalidArgumentError(f"batch: drafted row {row} has penalties or min_tokens but no history")
            at.histories = at.histories or DraftHistories(history)
            drafts = seq.token_ids[1:]
            for i in range(n):
                at.histories.add(first + i, seq.state_slot, drafts[:i])
        at.spans.append((row, first))
        at.logits.append(row_logits)
        at.params.extend([p] * n)
        at.positions.extend(range(seq.start_pos + 1, seq.start_pos + 1 + n))
    return at


def _accept(
    sampled: StepOutput, batch: Batch, spans: Sequence[tuple[int, int]], drawn: StepOutput, index_of: dict[int, int]
) -> StepOutput:
    """`sampled` with each drafted row's verification (`spans` into `drawn`, every stacked position's
    token): its drafts accepted up to the first that differs from the token drawn there, and the token
    drawn after the last accepted in place of the row's own."""
    seqs = batch.sequences
    token_ids, logprobs = list(sampled.token_ids), list(sampled.logprobs)
    tops = list(sampled.top_logprobs) if sampled.top_logprobs is not None else None
    verified: list[Verified] = []
    for row, first in spans:
        seq = seqs[row]
        drafts = seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]
        j = 0
        while j < len(drafts) and drawn.token_ids[first + j] == drafts[j]:
            j += 1
        at = range(first, first + j)
        row_tops = drawn.top_logprobs
        verified.append(Verified(
            row, len(drafts), tuple(drafts[:j]), tuple(drawn.logprobs[i] for i in at),
            tuple(row_tops[i] for i in at) if row_tops is not None else ((),) * j,
        ))  # fmt: skip
        k = index_of[row]
        token_ids[k], logprobs[k] = drawn.token_ids[first + j], drawn.logprobs[first + j]
        if row_tops is not None:
            if tops is None:
                tops = [()] * len(token_ids)
            tops[k] = row_tops[first + j]
    return replace(sampled, token_ids=token_ids, logprobs=logprobs, top_logprobs=tops, drafts=tuple(verified))


def roll_back(
    state_pool: MambaStatePool, batch: Batch, verified: Sequence[Verified], records: Sequence[Any] | None = None
) -> None:
    """Each drafted row's slot to the state after its last accepted token (module docstring): rebuilt from
    the forward's short-span `records` (ForwardOutput.draft_records) when it kept them, else copied from
    the draft rows `with_draft_rows` assigned (in batch order, `num_draft_tokens` each)."""
    if not verified:
        return
    seqs = batch.sequences
    if records is not None:
        rejected = [v for v in verified if len(v.token_ids) < v.num_drafted]
        if rejected:  # the state after chunk token `accepted` (the newest token is token 0)
            slots, ends = [seqs[v.row].state_slot for v in rejected], [len(v.token_ids) for v in rejected]
            for record in records:
                record.restore(slots, ends)
        return
    base: dict[int, int] = {}
    used = 0
    for i in drafted_rows(batch):
        base[i] = used
        used += seqs[i].num_draft_tokens
    for v in verified:
        accepted = len(v.token_ids)
        if accepted < v.num_drafted:  # the state after token offset 1 + accepted: draft row index `accepted`
            state_pool.restore_draft_row(base[v.row] + accepted, seqs[v.row].state_slot)
