"""The packed batch the engine hands the runner each step, and what the runner returns.

Sequences are packed back to back without padding; each is either a multi-token prefill chunk or a single
token (a decode, or a 1-token prefill chunk: the runner treats both the same way). Region map of one
sequence in a step:
    [0, start_pos)                     computed earlier: KV in its pages, Mamba state in its slot
    [start_pos, start_pos + len)       this chunk: KV written, state advanced
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any, NamedTuple

import torch


class SequenceChunk(NamedTuple):
    """One sequence's work in a step.

    A NamedTuple, immutable like a frozen dataclass: one is built per sequence every step, and a
    frozen dataclass costs two to four times as much to construct.
    """

    token_ids: tuple[int, ...]  # the chunk's tokens, absolute positions [start_pos, start_pos + len)
    start_pos: int  # tokens of this sequence already computed; 0 = start from a zero state
    page_ids: tuple[int, ...]  # KV page table covering at least [0, start_pos + len) (kv_page_size units)
    state_slot: int  # live Mamba state slot; holds the state at start_pos (ignored when start_pos == 0)
    save_checkpoint_id: int | None = None  # copy the end-of-chunk state here (chunk ends on the grid)
    # (position, checkpoint id): keep the state after token `position` (start_pos < position <
    # start_pos + len, a block boundary inside the chunk) in that checkpoint slot
    boundary_checkpoints: tuple[tuple[int, int], ...] = ()
    # prompt log-probabilities: score the chunk's tokens after its first, given those before, and
    # `next_token` (the prompt token after the chunk; -1 = none) at its last position
    score: bool = False
    next_token: int = -1
    # speculation: the chunk's last `num_draft_tokens` tokens are drafts (a decode's newest token first,
    # then the drafts); the step verifies them and keeps the state after the last accepted one
    # (gpu_worker.runner.speculation)
    num_draft_tokens: int = 0
    # multi-token prediction (gpu_worker.runner.mtp): -1 = the row does not use the MTP head; else the head
    # runs over the positions the step computes for it (its KV kept complete), with the token after each,
    # and proposes this many drafts to follow the row's next token (0: none, the head's KV only). The
    # token after the chunk's last position is `next_token` when the chunk ends inside the known tokens,
    # else the one the step samples.
    mtp_drafts: int = -1


_TOKEN_IDS = attrgetter("token_ids")


@dataclass(frozen=True, slots=True)
class Batch:
    """All sequences of one forward. A state slot appears at most once."""

    sequences: tuple[SequenceChunk, ...]
    return_all_logits: bool = False  # also return logits at every position (tests, prompt logprobs)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the multi-token chunks (every chunk has at least one token)."""
        lengths = list(map(len, map(_TOKEN_IDS, self.sequences)))  # C loops: the engine reads it every step
        return sum(lengths) - lengths.count(1)


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """Logits of one forward, in batch sequence order. Tensors live on the runner's device."""

    logits: torch.Tensor  # [num_sequences, vocab] float32: logits after each sequence's last token
    all_logits: tuple[torch.Tensor, ...] | None = None  # per sequence [len, vocab] float32, if asked
    # (batch row, log-probabilities) of each row that scores (SequenceChunk.score), in batch order
    prompt_scores: tuple[tuple[int, list[float]], ...] = ()
    # (batch row, [1 + drafts, vocab] float32) of each row with drafts: the logits at every position of its chunk
    draft_logits: tuple[tuple[int, torch.Tensor], ...] = ()
    # speculation on CPU: each Mamba layer's short spans, to rebuild a rejected row's state (None: draft rows)
    draft_records: tuple[Any, ...] | None = None
    # multi-token prediction (SequenceChunk.mtp_drafts): the final hidden states [T, hidden] of every packed
    # token and each row's first packed index, for the MTP head after sampling; None when no row uses it
    hidden: torch.Tensor | None = None
    token_start: tuple[int, ...] = ()
    # each row's first maximal token [num_sequences] int64 and log-normaliser [num_sequences] float32 of
    # `logits`, where a compiled decode program computed them (the sampler then reads them); None otherwise
    stats: tuple[torch.Tensor, torch.Tensor] | None = None


def score_targets(seq: SequenceChunk) -> list[int]:
    """The tokens a scoring chunk's positions predict: its own after the first, then `next_token`."""
    return list(seq.token_ids[1:]) + ([seq.next_token] if seq.next_token >= 0 else [])
