"""Per-forward metadata: where each packed token sits, which KV slots and state rows it uses.

Built once per step by `gpu_worker.runner.input_builder` and shared by every layer. Token order inside the
packed batch is: all single-token sequences first, sorted by state slot (the "decode group", run
through attention and the Mamba recurrence together), then each multi-token chunk as a contiguous span.

Index maps (flat KV slot = page_id * kv_page_size + offset in page):
    packed tokens   [0, num_decode) decode group | [span.token_start, +span.num_tokens) per prefill span
    span context    [0, start_pos) cached KV | [start_pos, start_pos + num_tokens) this chunk's KV
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """One multi-token chunk of one sequence inside the packed batch."""

    token_start: int  # first packed-token index of the chunk
    num_tokens: int  # chunk length (tokens), >= 2
    start_pos: int  # tokens of this sequence computed before the chunk (= absolute position of token 0)
    state_slot: int  # Mamba state pool row this sequence reads and writes
    kv_slots: torch.Tensor  # [start_pos + num_tokens] int64: flat KV slot of every context position


@dataclass(frozen=True, slots=True)
class BoundaryState:
    """Keep the Mamba state inside a prefill chunk: after its first `offset` tokens (a block
    boundary the chunk crosses), copy every layer's conv window and SSM state to pool row `row`."""

    span_index: int  # index into ForwardContext.prefills
    offset: int  # tokens of the chunk before the boundary, 0 < offset < span.num_tokens
    row: int  # state pool storage row (a checkpoint slot) that receives the state


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """Tensor metadata for one forward over a packed batch; valid for that forward only."""

    positions: torch.Tensor  # [T] int64: absolute position of each packed token
    kv_write_slots: torch.Tensor  # [T] int64: flat KV slot each token's K/V is written to
    num_decode: int  # leading packed tokens that are single-token sequences
    decode_state_slots: torch.Tensor  # [num_decode] int64: state pool rows of the decode group (ascending)
    decode_slot_start: int | None  # set when decode_state_slots == range(start, start + num_decode)
    kv_page_size_tokens: int  # tokens per KV page
    decode_page_table: torch.Tensor  # [num_decode, max_pages] int64: page ids (padded with page 0)
    decode_kv_mask: torch.Tensor  # [num_decode, 1, 1, max_pages * page size] bool: True at real positions
    prefills: tuple[PrefillSpan, ...]  # multi-token chunks, in packed order after the decode group
    boundary_states: tuple[BoundaryState, ...] = ()  # states to keep inside prefill chunks, by span
    # index maps derived from the fields above by the first layer that needs them, shared by the rest
    # (e.g. gpu_worker.model.backends.cpu.packed_prefill's); never part of the context's identity
    derived: dict[object, object] = field(default_factory=dict, compare=False, repr=False)

    def boundaries_of(self, span_index: int) -> tuple[BoundaryState, ...]:
        """The boundary states wanted inside prefill span `span_index`."""
        return tuple(b for b in self.boundary_states if b.span_index == span_index)
