"""A speculative step's verify forward through a whole step compiled or captured ahead of time, where one
holds it: the CPU's compiled programs (gpu_worker.model.backends.cpu.compiled_step; `through_programs`) or
the CUDA graphs of verify steps (gpu_worker.runner.cuda_graphs.VerifyGraphs; `through_graphs`). Each
returns the step's ForwardOutput: the logits at each row's last position and at every drafted position,
and the Mamba layers' span tensors, from which the rollback rebuilds a rejected row's state
(short_scan.StackedSpanRecord). The runner saves the step's checkpoints after it; a step neither holds runs
the eager forward (gpu_worker.runner.runner)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from gpu_worker.model.backends.cpu.compiled_step import MIN_PAGE_COLUMNS, CompiledDecodeSteps
from gpu_worker.model.backends.cpu.short_scan import StackedSpanRecord, restore_rows
from gpu_worker.runner.batch import Batch, ForwardOutput
from gpu_worker.runner.cuda_graphs import VerifyGraphs, pick_bucket
from gpu_worker.runner.input_builder import (
    PackedInputs,
    VerifyInputs,
    build_inputs,
    build_verify_inputs,
    validate_batch,
)
from gpu_worker.runner.state_pool import MambaStatePool
from gpu_worker.runner.tuning import StepThreads


def verify_columns(inputs: VerifyInputs) -> tuple[torch.Tensor, ...]:
    """The verify program's tensor arguments (decode_program.verify_logits), in order."""
    return (inputs.input_ids, inputs.positions, inputs.write_slots, inputs.lengths, inputs.state_slots,
            inputs.page_table)  # fmt: skip


def through_programs(
    batch: Batch, programs: CompiledDecodeSteps, state_pool: MambaStatePool, page_size: int, device: torch.device,
    step_threads: StepThreads | None, heads: bool,
) -> ForwardOutput | None:  # fmt: skip
    """A step of verify rows, and plain decodes beside them, through the compiled programs: the drafted rows
    through their bucket's verify program (every position's logits, and the span tensors, as the eager
    short-span scan leaves them), the others through the decode program of theirs. Two calls rather than the
    plain rows padded to 1 + k positions: a verify row costs about three plain ones (bench_decode: 8 verify
    rows 20.5 ms, 8 decode rows 6.0, one verify row 6.1), so one drafted row among eight would cost the step
    20.5 ms padded and about 12 split. With `heads` (the MTP head runs after the step) the final hidden
    states of every position come back laid out as the eager forward's (`program_hidden`). None when no
    program holds the step (the caller runs it eagerly)."""
    seqs = batch.sequences
    length = programs.verify_tokens
    drafted = [i for i, s in enumerate(seqs) if s.num_draft_tokens]
    plain = [i for i, s in enumerate(seqs) if not s.num_draft_tokens]
    bucket = programs.verify_bucket_for(len(drafted))
    if bucket is None or programs.status != "ready" or (plain and programs.bucket_for(len(plain)) is None):
        return None
    if any(len(seqs[i].token_ids) > 1 for i in plain) or any(len(seqs[i].token_ids) > length for i in drafted):
        return None  # a prefill chunk (the packed paths), or more drafts than the programs take
    num_slots = state_pool.num_slots
    validate_batch(batch, page_size, num_slots)
    inputs = build_verify_inputs(
        Batch(tuple(seqs[i] for i in drafted)), page_size, num_slots, length, bucket, MIN_PAGE_COLUMNS
    )  # fmt: skip
    if step_threads is not None:  # a decode step's threads (a verify row is no prefill to widen for)
        step_threads.for_step(sum(len(s.token_ids) for s in seqs), 0)
    packed = build_inputs(Batch(tuple(seqs[i] for i in plain)), page_size, num_slots, device) if plain else None
    if inputs.fresh_slots is not None:
        state_pool.zero_slots(inputs.fresh_slots)
    ran = programs.run_verify(*verify_columns(inputs))
    if ran is None:  # nothing ran
        return None
    logits, spans, verify_hidden = ran
    plain_logits = plain_hidden = None
    if packed is not None:
        if packed.fresh_slots is not None:
            state_pool.zero_slots(packed.fresh_slots)
        compiled = programs.run(packed.ctx, packed.input_ids)
        if compiled is None:  # its bucket and readiness were checked: the drafted rows ran already
            raise RuntimeError(f"no decode program took the step's {len(plain)} plain rows")
        plain_logits = compiled[0].index_select(0, packed.last_index)
        plain_hidden = compiled[3]
    real = slice(inputs.num_padding, None)
    logits = logits[real]  # [drafted rows, L, vocab]
    verify_last = logits[torch.arange(len(drafted)), inputs.lengths[real] - 1]
    last = verify_last
    if plain_logits is not None:
        last = verify_last.new_empty(len(seqs), verify_last.shape[-1])
        last[drafted], last[plain] = verify_last, plain_logits
    drafts = tuple((i, logits[k, : 1 + seqs[i].num_draft_tokens]) for k, i in enumerate(drafted))
    slots = tuple(seqs[i].state_slot for i in drafted)
    records = span_records(state_pool, inputs.num_padding, slots, spans, programs.restore)
    out = ForwardOutput(logits=last, draft_logits=drafts, draft_records=records)
    if not heads:
        return out
    hidden, token_start = program_hidden(verify_hidden[real], drafted, plain_hidden, plain, packed)
    return replace(out, hidden=hidden, token_start=token_start)


def through_graphs(
    batch: Batch, graphs: VerifyGraphs, state_pool: MambaStatePool, page_size: int, device: torch.device
) -> ForwardOutput:
    """A verify step replayed from its bucket's CUDA graph (every row padded to L positions, the plain ones
    too; the caller checked `graphs.can_run`)."""
    seqs = batch.sequences
    bucket = pick_bucket(graphs.buckets, len(seqs))
    assert bucket is not None  # can_run checked the rows
    inputs = build_verify_inputs(batch, page_size, state_pool.num_slots, graphs.length, bucket, MIN_PAGE_COLUMNS)
    if inputs.fresh_slots is not None:  # a one-token prompt's only chunk, beside the drafted rows
        state_pool.zero_slots(inputs.fresh_slots.to(device))
    logits, spans = graphs.run(inputs)
    logits = logits[inputs.num_padding :]  # [rows, L, vocab]
    ends = (inputs.lengths[inputs.num_padding :] - 1).to(device)
    last = logits[torch.arange(len(seqs), device=device), ends]
    drafts = tuple((i, logits[i, : 1 + s.num_draft_tokens]) for i, s in enumerate(seqs) if s.num_draft_tokens)
    records = span_records(state_pool, inputs.num_padding, tuple(s.state_slot for s in seqs), spans, restore_rows)
    return ForwardOutput(logits=last, draft_logits=drafts, draft_records=records)


def span_records(
    state_pool: MambaStatePool, num_padding: int, slots: tuple[int, ...], spans: list[torch.Tensor],
    program: Callable[..., None],
) -> tuple[StackedSpanRecord, ...]:  # fmt: skip
    """ForwardOutput.draft_records of a verify step that returned the stacked `spans` for its rows (`slots`,
    after `num_padding` padding rows, which answer to no slot): whole, as the rollback's program was compiled
    on. Empty where the model has no Mamba layer."""
    if not spans:
        return ()
    initial, a, xdt, B, windows = spans
    conv, ssm = state_pool.stacked_states()
    return (StackedSpanRecord(conv, ssm, (-1,) * num_padding + slots, initial, a, xdt, B, windows, program),)


def program_hidden(
    verify_hidden: torch.Tensor, drafted: list[int], plain_hidden: torch.Tensor | None, plain: list[int],
    packed: PackedInputs | None,
) -> tuple[torch.Tensor, tuple[int, ...]]:  # fmt: skip
    """ForwardOutput.hidden and token_start of a verify step through the programs, laid out as the eager
    forward's: the drafted rows' L positions each ([drafted, L, hidden], in batch order), then the plain
    rows' decode group (`plain_hidden`, packed by `packed`); token_start[i] is batch row i's first position."""
    length = verify_hidden.shape[1]
    starts = [0] * (len(drafted) + len(plain))
    for k, i in enumerate(drafted):
        starts[i] = k * length
    flat = verify_hidden.reshape(-1, verify_hidden.shape[-1])
    if plain_hidden is None or packed is None:
        return flat, tuple(starts)
    for j, i in enumerate(plain):
        starts[i] = len(flat) + packed.token_start[j]
    return torch.cat([flat, plain_hidden]), tuple(starts)
