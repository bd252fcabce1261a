"""Turns a `Batch` into packed input ids and the `ForwardContext` every layer reads.

Packing order: single-token sequences first (the decode group), then multi-token chunks. `last_index`
maps each batch sequence (in batch order) to the packed index of its last token, so logits come back in
the caller's order without a reshuffle."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from gpu_worker.model.context import BoundaryState, ForwardContext, PrefillSpan
from gpu_worker.runner.batch import Batch, SequenceChunk
from hybridserve.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class PackedInputs:
    input_ids: torch.Tensor  # [T] int64
    ctx: ForwardContext
    last_index: torch.Tensor  # [num_sequences] int64, batch order -> packed index of the last token
    token_start: tuple[int, ...]  # per batch sequence: packed index of its first token
    fresh_slots: torch.Tensor | None  # [k] int64 state slots to zero before the forward (start_pos == 0)


def _validate(seq: SequenceChunk, page_size: int, num_slots: int) -> None:
    n = len(seq.token_ids)
    if n == 0:
        raise InvalidArgumentError(f"batch: sequence in state slot {seq.state_slot} has no tokens")
    if seq.start_pos < 0 or len(seq.page_ids) * page_size < seq.start_pos + n:
        raise InvalidArgumentError(
            f"batch: {len(seq.page_ids)} KV pages of {page_size} tokens cannot hold positions "
            f"[0, {seq.start_pos + n}) (state slot {seq.state_slot})"
        )
    if not 0 <= seq.state_slot < num_slots:
        raise InvalidArgumentError(f"batch: state slot {seq.state_slot} outside [0, {num_slots})")
    for position, checkpoint_id in seq.boundary_checkpoints:
        if not seq.start_pos < position < seq.start_pos + n or checkpoint_id < 0:
            raise InvalidArgumentError(
                f"batch: boundary checkpoint {checkpoint_id} at position {position} is not inside the chunk "
                f"[{seq.start_pos}, {seq.start_pos + n}) of state slot {seq.state_slot}"
            )


def _boundary_states(span_index: int, seq: SequenceChunk, num_slots: int) -> list[BoundaryState]:
    """The chunk's inner boundary checkpoints as pool rows (checkpoint c is row num_slots + c)."""
    return [BoundaryState(span_index, pos - seq.start_pos, num_slots + cid) for pos, cid in seq.boundary_checkpoints]


def _context_slots(page_ids: tuple[int, ...], num_positions: int, page_size: int) -> torch.Tensor:
    """Flat KV slots of positions [0, num_positions) for one page table -> [num_positions] int64."""
    num_pages = -(-num_positions // page_size)
    pages = torch.tensor(page_ids[:num_pages], dtype=torch.int64)
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:num_positions]


@lru_cache(maxsize=64)
def _key_positions(width: int) -> torch.Tensor:
    """[1, 1, 1, width] int64 0..width-1: the decode mask's key positions, one tensor per width."""
    return torch.arange(width, dtype=torch.int64).view(1, 1, 1, width)


def _decode_tables(
    seqs: list[SequenceChunk], page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Page table [b, max_pages] (padded with page 0), mask [b, 1, 1, max_pages * page_size], positions [b]
    and KV write slots [b] of the single-token sequences `seqs`.

    Index math in Python, five tensor calls in all: each torch call gives up the GIL, and taking it
    back beside a serving worker's stream threads cost more than the call (about 1 ms a step at 32
    decodes with the fourteen calls this took before)."""
    if not seqs:
        empty = torch.zeros(0, dtype=torch.int64)
        return torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 1, 1, page_size, dtype=torch.bool), empty, empty
    starts = [s.start_pos for s in seqs]
    max_pages = max(starts) // page_size + 1  # pages holding positions [0, start + 1)
    rows = [list(s.page_ids[:max_pages]) + [0] * max(0, max_pages - len(s.page_ids)) for s in seqs]
    write_slots = [s.page_ids[p // page_size] * page_size + p % page_size for s, p in zip(seqs, starts, strict=True)]
    table = torch.tensor(rows, dtype=torch.int64)
    pos = torch.tensor(starts, dtype=torch.int64)
    mask = _key_positions(max_pages * page_size) <= pos.view(len(seqs), 1, 1, 1)
    return table, mask, pos, torch.tensor(write_slots, dtype=torch.int64)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of `parts`, or the one part itself (a decode-only step): one torch call fewer."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def validate_batch(batch: Batch, page_size: int, num_slots: int) -> None:
    """Raises InvalidArgumentError for an empty batch, a state slot given twice, or a sequence whose pages,
    slot or boundary checkpoints do not fit its chunk."""
    seqs = batch.sequences
    if not seqs:
        raise InvalidArgumentError("batch: no sequences")
    if len({s.state_slot for s in seqs}) != len(seqs):
        raise InvalidArgumentError("batch: a state slot appears in more than one sequence")
    for s in seqs:
        _validate(s, page_size, num_slots)


@dataclass(frozen=True, slots=True)
class VerifyInputs:
    """A step of rows of at most L tokens each (decodes and verify rows) laid out [rows, L] for the
    compiled verify program (gpu_worker.model.backends.cpu.decode_program.verify_logits), padded to a
    bucket of rows: the padding rows first, each repeating row 0 (as compiled_step pads decode steps)."""

    input_ids: torch.Tensor  # [bucket, L] int64; a padded position repeats its row's last token
    positions: torch.Tensor  # [bucket, L] int64
    write_slots: torch.Tensor  # [bucket, L] int64; a padded position: its row's last real slot
    lengths: torch.Tensor  # [bucket] int64: real tokens per row
    state_slots: torch.Tensor  # [bucket] int64
    page_table: torch.Tensor  # [bucket, W] int64, W >= min_columns (padded with page 0)
    fresh_slots: torch.Tensor | None  # state slots to zero before the step (a chunk at position 0)
    num_padding: int  # leading padding rows; batch row i is row num_padding + i


def build_verify_inputs(
    batch: Batch, page_size: int, num_slots: int, length: int, bucket: int, min_columns: int
) -> VerifyInputs:
    """Validate and lay out `batch` (every chunk at most `length` tokens, at most `bucket` sequences) as
    VerifyInputs. Index math in Python, a tensor call per field."""
    validate_batch(batch, page_size, num_slots)
    seqs = batch.sequences
    pad = bucket - len(seqs)
    order = [0] * pad + list(range(len(seqs)))
    columns = max(min_columns, max((s.start_pos + len(s.token_ids) - 1) // page_size + 1 for s in seqs))
    ids, positions, writes, tables = [], [], [], []
    for i in order:
        s = seqs[i]
        n = len(s.token_ids)
        ids.append(list(s.token_ids) + [s.token_ids[-1]] * (length - n))
        row = [s.start_pos + t for t in range(length)]
        positions.append(row)
        last = s.start_pos + n - 1
        writes.append([s.page_ids[p // page_size] * page_size + p % page_size for p in (min(p, last) for p in row)])
        tables.append(list(s.page_ids[:columns]) + [0] * max(0, columns - len(s.page_ids)))
    fresh = [s.state_slot for s in seqs if s.start_pos == 0]
    return VerifyInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        write_slots=torch.tensor(writes, dtype=torch.int64),
        lengths=torch.tensor([len(seqs[i].token_ids) for i in order], dtype=torch.int64),
        state_slots=torch.tensor([seqs[i].state_slot for i in order], dtype=torch.int64),
        page_table=torch.tensor(tables, dtype=torch.int64),
        fresh_slots=torch.tensor(fresh, dtype=torch.int64) if fresh else None,
        num_padding=pad,
    )


def build_inputs(batch: Batch, page_size: int, num_slots: int, device: torch.device) -> PackedInputs:
    """Validate and pack `batch` (see module docstring). All index math runs on CPU, then moves once."""
    seqs = batch.sequences
    validate_batch(batch, page_size, num_slots)
    decode_ids = sorted((i for i, s in enumerate(seqs) if len(s.token_ids) == 1), key=lambda i: seqs[i].state_slot)
    prefill_ids = [i for i, s in enumerate(seqs) if len(s.token_ids) > 1]
    token_start = [0] * len(seqs)
    ids: list[int] = []
    positions: list[torch.Tensor] = []
    write_slots: list[torch.Tensor] = []

    # decode group: [0, nd)
    nd = len(decode_ids)
    for j, i in enumerate(decode_ids):
        token_start[i] = j
        ids.append(seqs[i].token_ids[0])
    table, decode_mask, pos, slots = _decode_tables([seqs[i] for i in decode_ids], page_size)
    if nd:
        positions.append(pos)
        write_slots.append(slots)

    # prefill spans: [nd, T)
    spans: list[PrefillSpan] = []
    boundaries: list[BoundaryState] = []
    for i in prefill_ids:
        s = seqs[i]
        n = len(s.token_ids)
        boundaries.extend(_boundary_states(len(spans), s, num_slots))
        token_start[i] = len(ids)
        kv = _context_slots(s.page_ids, s.start_pos + n, page_size)
        spans.append(PrefillSpan(len(ids), n, s.start_pos, s.state_slot, kv.to(device)))
        ids.extend(s.token_ids)
        positions.append(torch.arange(s.start_pos, s.start_pos + n))
        write_slots.append(kv[s.start_pos :])

    last_index = torch.tensor([token_start[i] + len(s.token_ids) - 1 for i, s in enumerate(seqs)])
    fresh = [s.state_slot for s in seqs if s.start_pos == 0]
    decode_slots = [seqs[i].state_slot for i in decode_ids]
    is_run = nd > 0 and decode_slots[-1] - decode_slots[0] == nd - 1  # sorted and distinct: contiguous

    def on(t: torch.Tensor) -> torch.Tensor:
        """The index math ran on CPU; on a CPU device no `.to` call (each torch call gives up the GIL)."""
        return t if device.type == "cpu" else t.to(device)

    ctx = ForwardContext(
        positions=on(_joined(positions)),
        kv_write_slots=on(_joined(write_slots)),
        num_decode=nd,
        decode_state_slots=on(torch.tensor(decode_slots, dtype=torch.int64)),
        decode_slot_start=decode_slots[0] if is_run else None,
        kv_page_size_tokens=page_size,
        decode_page_table=on(table),
        decode_kv_mask=on(decode_mask),
        prefills=tuple(spans),
        boundary_states=tuple(boundaries),
    )
    return PackedInputs(
        input_ids=on(torch.tensor(ids, dtype=torch.int64)),
        ctx=ctx,
        last_index=on(last_index),
        token_start=tuple(token_start),
        fresh_slots=on(torch.tensor(fresh, dtype=torch.int64)) if fresh else None,
    )
