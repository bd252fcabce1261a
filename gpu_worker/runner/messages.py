"""What the worker and its model processes say to each other (gpu_worker.runner.model_process): typed,
versioned messages over a pipe, and the tables both sides read in shared memory.

A step travels small. The rows' page tables, the special rows' sampling parameters (logit_bias and the ids
min_tokens holds off included) and the penalties' per-request state (`HistoryTables`: generated-token
counts, prompt tokens, generated count) live in `StepTables`, in memory every model process maps, indexed
by state slot: the worker writes what changed since it last wrote (a page table grows by a page every
`kv_page_size` tokens; a request's parameters and its history are written once, when it first samples in
its slot, then its history gains the token each step sampled), so any model process can compute any row,
whatever process computed it the step before (`Split` moves rows between processes). A `Step` then
carries, per row, eleven integers and its chunk's tokens; a `StepDone` the sampled token ids, their
log-probabilities, the top alternatives only for rows that asked, and the prompt log-probabilities of rows
that score their prompt (SequenceChunk.score). Logits come back only when a caller asks for them
(`Step.want_logits`: tests and tools).

Rows a grammar constrains (structured outputs) are marked in `Step.rows` (MASKED). Their token masks are
built by the worker while the step's forward runs, written into `StepTables.masks` at the rows' slots
(vocab/32 int32 words each), and announced by a `MasksReady` sent after the `Step`: a model process whose
part has masked rows reads it once its forward is done, then samples with the masks applied.

Every message is a frozen dataclass, pickled; `Ready` carries `PROTOCOL_VERSION`, and the worker refuses a
model process that speaks another."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gpu_worker.runner.batch import Batch, ForwardOutput, SequenceChunk
from gpu_worker.runner.history import HistoryTables, HistoryWriter, history_capacity
from gpu_worker.runner.sampling import (
    EMPTY_OUTPUT,
    MAX_HELD_TOKENS,
    MAX_LOGIT_BIAS_TOKENS,
    PromptScores,
    SamplingParams,
    StepOutput,
    StepSampling,
    TopLogprobs,
)
from gpu_worker.runner.shared_memory import Allocator
from gpu_worker.runner.speculation import Verified
from gpu_worker.runner.token_masks import draft_mask_rows, mask_vocab_size, mask_words
from gpu_worker.runner.warmup import WarmupTimes
from hybridserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from gpu_worker.model.loader import LoadedModel

PROTOCOL_VERSION = 6  # 2: the sampling controls' parameters and history, prompt scores (or the masks); 3: both;
# 4: a row's draft tokens (speculation), and the drafts' verifications back; 5: a row's MTP drafts asked, the
# MTP head's proposals back; 6: the masks of constrained verify rows' draft positions in the tables
# Step.rows' columns
SLOT, START, NUM_TOKENS, NUM_PAGES, SAVE_CHECKPOINT, YIELDS, SPECIAL, MASKED, SCORE, NEXT_TOKEN, DRAFTS = range(11)
ROW_FIELDS = 12
_NO_CHECKPOINT = -1


# ---- messages -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    """A model process loaded its model over the shared weights and pools."""

    version: int
    describe: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Failed:
    """A request the model process could not carry out; `invalid`: a malformed batch (nothing changed)."""

    message: str
    invalid: bool = False


@dataclass(frozen=True, slots=True)
class WarmUp:
    steps: tuple[Batch, ...]  # whole batches: the warm-up's scratch steps, once at start-up


@dataclass(frozen=True, slots=True)
class Warm:
    times: WarmupTimes


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Step:
    """One step's part for one model process."""

    rows: np.ndarray[Any, Any]  # [n, ROW_FIELDS] int64, batch order
    tokens: np.ndarray[Any, Any]  # int32: every row's chunk tokens, back to back
    boundaries: tuple[tuple[int, int, int], ...] = ()  # (row, position, checkpoint id) inside chunks
    want_logits: bool = False  # send the rows' last-position logits back too
    all_logits: bool = False  # ... and every position's (Batch.return_all_logits)


@dataclass(frozen=True, slots=True)
class MasksReady:
    """The masks of the last `Step`'s masked rows are in `StepTables.masks` (sent only to a process whose
    part has masked rows, after its `Step`)."""


@dataclass(frozen=True, slots=True)
class StepDone:
    """A step's part done: one sampled token per yielding row of the part, in row order."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs] | None
    seconds: float  # the part's compute time (Split learns each process's speed from it)
    widened: bool  # the part ran on idle processes' cores too (StepThreads.widen)
    compile_status: str
    logits: np.ndarray[Any, Any] | None = None  # [n, vocab] float32 when asked
    all_logits: list[np.ndarray[Any, Any]] | None = None
    prompt_scores: PromptScores = ()  # (row of the part, log-probabilities) of the rows that score
    drafts: tuple[Verified, ...] = ()  # the drafted rows' verifications, rows of the part
    proposals: tuple[tuple[int, tuple[int, ...]], ...] = ()  # the MTP head's drafts (row of the part, drafts)


# ---- the shared tables ---------------------------------------------------------------------------------
class StepTables:
    """Per state slot: the page table (int32, up to `max_pages`), the sampling parameters of the request in
    the slot (`floats`: temperature, top-p, presence, frequency, repetition, min-p; `ints`: top-k,
    alternatives, seed, has-seed, min_tokens, logit_bias entries, held ids; logit_bias's ids and values and
    the held ids in tables of their own; a version bumped on each write), its history (`history`, for
    the penalties) and the token mask of a constrained row (`masks`: `mask_words` int32 words, written each
    step it samples; after the slots' rows, `draft_mask_rows` more for the positions of constrained verify
    rows, laid out by token_masks.draft_mask_rows from row `num_slots` on). Built over an `Allocator`: the
    worker's shared arena, or the same tensors attached in a model process (in the same order)."""

    def __init__(
        self, num_slots: int, max_pages: int, vocab: int, page_size: int, alloc: Allocator, mask_words: int = 1,
        draft_mask_rows: int = 0,
    ) -> None:  # fmt: skip
        self.num_slots = num_slots
        self.max_pages = max_pages
        self.pages = alloc((num_slots, max_pages), torch.int32).numpy()
        self.floats = alloc((num_slots, 6), torch.float64).numpy()
        self.ints = alloc((num_slots, 7), torch.int64).numpy()
        self.bias_ids = alloc((num_slots, MAX_LOGIT_BIAS_TOKENS), torch.int32).numpy()
        self.bias_values = alloc((num_slots, MAX_LOGIT_BIAS_TOKENS), torch.float32).numpy()
        self.held = alloc((num_slots, MAX_HELD_TOKENS), torch.int32).numpy()
        self.versions = alloc((num_slots,), torch.int64).numpy()
        self.history = HistoryTables(num_slots, history_capacity(vocab, max_pages, page_size), alloc)
        # a row per slot, then `draft_mask_rows` rows for the draft positions of constrained verify rows
        self.masks = alloc((num_slots + draft_mask_rows, mask_words), torch.int32).numpy()
        self.draft_mask_rows = draft_mask_rows

    def write_params(self, slot: int, p: SamplingParams) -> None:
        self.floats[slot] = (p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                             p.min_p)  # fmt: skip
        seed = p.seed if p.seed is not None else 0
        nb, nh = len(p.logit_bias), len(p.held_token_ids)
        self.ints[slot] = (p.top_k, p.num_logprobs, seed, p.seed is not None, p.min_tokens, nb, nh)
        if nb:
            self.bias_ids[slot, :nb] = [t for t, _ in p.logit_bias]
            self.bias_values[slot, :nb] = [b for _, b in p.logit_bias]
        if nh:
            self.held[slot, :nh] = p.held_token_ids
        self.versions[slot] += 1

    def read_params(self, slot: int) -> SamplingParams:
        temperature, top_p, presence, frequency, repetition, min_p = self.floats[slot].tolist()
        top_k, num_logprobs, seed, has_seed, min_tokens, nb, nh = self.ints[slot].tolist()
        bias = tuple(zip(self.bias_ids[slot, :nb].tolist(), self.bias_values[slot, :nb].tolist(), strict=True))
        return SamplingParams(
            temperature, int(top_k), top_p, int(seed) if has_seed else None, int(num_logprobs), presence, frequency,
            repetition, min_p, bias, int(min_tokens), tuple(self.held[slot, :nh].tolist()),
        )  # fmt: skip


class TableWriter:
    """The worker's side of `StepTables`: writes what changed since the last step it wrote."""

    def __init__(self, tables: StepTables) -> None:
        self.tables = tables
        self._pages: list[tuple[int, ...]] = [()] * tables.num_slots  # what each slot's row holds
        self._params: list[SamplingParams | None] = [None] * tables.num_slots
        self.history = HistoryWriter(tables.history)
        self.pages_written = 0  # page ids written, all steps (the diffs' size)

    def publish(self, batch: Batch, sampling: StepSampling) -> None:
        t = self.tables
        for seq in batch.sequences:
            slot, pages = seq.state_slot, seq.page_ids
            if not 0 <= slot < t.num_slots:
                raise InvalidArgumentError(f"batch: state slot {slot} outside [0, {t.num_slots})")
            old = self._pages[slot]
            if pages is old:  # the request's cached page table: unchanged since it was written
                continue
            if len(pages) > t.max_pages:
                raise InvalidArgumentError(f"batch: {len(pages)} pages for slot {slot}; the pool has {t.max_pages}")
            keep = len(old) if len(pages) >= len(old) and pages[: len(old)] == old else 0
            if len(pages) > keep:
                t.pages[slot, keep : len(pages)] = pages[keep:]
                self.pages_written += len(pages) - keep
            self._pages[slot] = pages
        seqs, rows = batch.sequences, sampling.rows
        for j, params in zip(sampling.special, sampling.params, strict=True):
            slot = seqs[rows[j]].state_slot
            if self._params[slot] is params:
                continue
            t.write_params(slot, params)
            self._params[slot] = params
        self.history.publish(batch, sampling)


def table_mask_words(loaded: LoadedModel) -> int:
    """The int32 words of a row's token mask in the tables, for this model (both sides compute it)."""
    tokenizer_vocab = loaded.tokenizer.vocab_size if loaded.tokenizer is not None else 0
    return mask_words(mask_vocab_size(loaded.config.vocab_size, tokenizer_vocab))


def masked_slots(batch: Batch, sampling: StepSampling) -> list[int]:
    """The state slots of the masked rows, in `sampling.masked` order (where their masks go in the tables)."""
    seqs, rows = batch.sequences, sampling.rows
    return [seqs[rows[j]].state_slot for j in sampling.masked]


def has_masked_rows(step: Step) -> bool:
    return bool(step.rows[:, MASKED].any())


def encode_step(batch: Batch, part: list[int] | None, sampling: StepSampling, want_logits: bool) -> Step:
    """`Step` of the batch rows `part` (ascending; None: every row), after `TableWriter.publish`."""
    seqs = batch.sequences if part is None else [batch.sequences[i] for i in part]
    yielding = set(sampling.rows)
    special = {sampling.rows[j] for j in sampling.special}
    masked = {sampling.rows[j] for j in sampling.masked}
    indices = range(len(seqs)) if part is None else part
    rows = np.array(
        [
            (s.state_slot, s.start_pos, len(s.token_ids), len(s.page_ids),
             _NO_CHECKPOINT if s.save_checkpoint_id is None else s.save_checkpoint_id, i in yielding, i in special,
             i in masked, s.score, s.next_token, s.num_draft_tokens, s.mtp_drafts)
            for s, i in zip(seqs, indices, strict=True)
        ],
        dtype=np.int64,
    ).reshape(-1, ROW_FIELDS)  # fmt: skip
    tokens = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), dtype=np.int32)
    boundaries = tuple((r, p, c) for r, s in enumerate(seqs) for p, c in s.boundary_checkpoints)
    return Step(rows, tokens, boundaries, want_logits, batch.return_all_logits)


class _TablesMasks:
    """The TokenMasks of a decoded step: its masks are in the tables (TableReader.masks_of), not built here."""

    words = 0

    def fill(self, bitmask: np.ndarray[Any, Any], indices: Sequence[int], before: Sequence[int] = ()) -> None:
        raise NotImplementedError("a model process reads its masks from the step tables")


_READ_FROM_TABLES = _TablesMasks()


class TableReader:
    """A model process's side: the batch and the sampling of a `Step`, from the message and the tables."""

    def __init__(self, tables: StepTables) -> None:
        self.tables = tables
        self._params: dict[int, tuple[int, SamplingParams]] = {}  # slot -> (version, params)

    def decode(self, step: Step) -> tuple[Batch, StepSampling, list[int]]:
        """The batch, its sampling (masked rows without their masks: `masks_of` reads them once they are
        ready), and the masked rows' slots."""
        pages = self.tables.pages
        tokens = step.tokens.tolist()
        inner: dict[int, list[tuple[int, int]]] = {}
        for r, position, checkpoint in step.boundaries:
            inner.setdefault(r, []).append((position, checkpoint))
        chunks: list[SequenceChunk] = []
        yielding: list[int] = []
        special: list[int] = []
        params: list[SamplingParams] = []
        masked: list[int] = []
        slots: list[int] = []
        offset = 0
        for r, row in enumerate(step.rows.tolist()):
            slot, start, n, num_pages, save, yields, is_special, is_masked, score, next_token, drafts, mtp = row
            if not 0 <= slot < self.tables.num_slots or not 0 <= num_pages <= self.tables.max_pages:
                raise InvalidArgumentError(f"step: state slot {slot} with {num_pages} pages is outside the tables")
            chunks.append(SequenceChunk(
                tuple(tokens[offset : offset + n]), start, tuple(pages[slot, :num_pages].tolist()), slot,
                None if save == _NO_CHECKPOINT else save, tuple(inner.get(r, ())), bool(score), next_token, drafts,
                mtp,
            ))  # fmt: skip
            offset += n
            if yields:
                if is_special:
                    special.append(len(yielding))
                    params.append(self._params_of(slot))
                if is_masked:
                    masked.append(len(yielding))
                    slots.append(slot)
                yielding.append(r)
        batch = Batch(tuple(chunks), return_all_logits=step.all_logits)
        sampling = StepSampling(tuple(yielding), tuple(special), tuple(params), tuple(masked),
                                _READ_FROM_TABLES if masked else None)  # fmt: skip
        return batch, sampling, slots

    def masks_of(self, slots: list[int], draft_counts: Sequence[int] = ()) -> tuple[torch.Tensor, list[int]]:
        """The masks at `slots` (the masked rows'), then those of their draft positions (the rows carrying
        `draft_counts` drafts, in masked order), copied out (the worker writes the next step's there); and
        where the latter start in the copy (TokenMasks.fill's `before`)."""
        tables = self.tables
        placed = draft_mask_rows(draft_counts, tables.num_slots, tables.draft_mask_rows)
        rows = list(slots) + [r for b, e in zip(placed, draft_counts, strict=True) if e for r in range(b, b + e)]
        return torch.from_numpy(tables.masks[rows]), draft_mask_rows(draft_counts, len(slots))

    def _params_of(self, slot: int) -> SamplingParams:
        version = int(self.tables.versions[slot])
        cached = self._params.get(slot)
        if cached is None or cached[0] != version:
            cached = self._params[slot] = (version, self.tables.read_params(slot))
        return cached[1]


# ---- replies into the runner's output --------------------------------------------------------------
def step_output(done: StepDone) -> StepOutput:
    return StepOutput(done.token_ids, done.logprobs, done.top_logprobs, done.prompt_scores, done.drafts, done.proposals)


def step_logits(done: StepDone) -> ForwardOutput:
    assert done.logits is not None
    all_logits = None if done.all_logits is None else tuple(torch.from_numpy(a) for a in done.all_logits)
    return ForwardOutput(logits=torch.from_numpy(done.logits), all_logits=all_logits)


def joined_output(parts: list[list[int]], done: list[StepDone], sampling: StepSampling) -> StepOutput:
    """The parts' tokens in `sampling.rows` order (each part's are its yielding rows, ascending)."""
    scores = tuple(sorted((part[r], v) for part, d in zip(parts, done, strict=True) for r, v in d.prompt_scores))
    drafts = tuple(sorted(v._replace(row=part[v.row]) for part, d in zip(parts, done, strict=True) for v in d.drafts))
    proposals = tuple(sorted((part[r], p) for part, d in zip(parts, done, strict=True) for r, p in d.proposals))
    if not sampling.rows:
        return StepOutput([], [], None, scores) if scores else EMPTY_OUTPUT
    yielding = set(sampling.rows)
    where: dict[int, tuple[StepDone, int]] = {}
    for part, d in zip(parts, done, strict=True):
        for j, row in enumerate(r for r in part if r in yielding):
            where[row] = (d, j)
    picked = [where[row] for row in sampling.rows]
    asked = any(d.top_logprobs is not None for d in done)
    top = [d.top_logprobs[j] if d.top_logprobs is not None else () for d, j in picked] if asked else None
    return StepOutput(
        [d.token_ids[j] for d, j in picked], [d.logprobs[j] for d, j in picked], top, scores, drafts, proposals
    )


def joined_logits(parts: list[list[int]], done: list[StepDone]) -> ForwardOutput:
    order = [i for p in parts for i in p]
    joined = torch.cat([torch.from_numpy(d.logits) for d in done if d.logits is not None])
    logits = torch.empty_like(joined)
    logits[torch.tensor(order)] = joined
    all_logits = None
    if done[0].all_logits is not None:
        flat = [a for d in done for a in (d.all_logits or [])]
        by_index = dict(zip(order, flat, strict=True))
        all_logits = tuple(torch.from_numpy(by_index[i]) for i in range(len(order)))
    return ForwardOutput(logits=logits, all_logits=all_logits)
