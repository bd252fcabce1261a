"""Structured outputs' token masks, as sampling reads them: one bit per token id, vocab/32 int32 words a
row (bit t % 32 of word t // 32 set: token t allowed), built by whoever owns the grammar matchers (the
engine: gpu_worker.engine.grammar) while the forward runs, behind the `TokenMasks` protocol (a verify row
of speculative decoding has one mask per position: `draft_mask_rows` lays them out). Here: the
masks' sizes, the unpacking of a mask into the tokens it refuses (`disallowed_tokens`: one numpy unpack
on CPU, a byte-to-bits table on a device), the mask step itself (`mask_rows_`, in place), and the bit test
of a chosen token (`outside_masks`) with which sampling (gpu_worker.runner.sampling.sample_rows) spares a
row the full-vocabulary mask when its unmasked choice is allowed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch


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

    def fill(self, bitmask: np.ndarray[Any, Any], indices: Sequence[int], before: Sequence[int] = ()) -> None:
        """Writes constrained row j's mask into row `indices[j]` of `bitmask` (int32 [n, words]): the mask of
        the token after the row's chunk. A row that carries e drafts (speculation) also has the masks of
        its e positions before, each after the drafts ahead of it, in rows `before[j]` .. `before[j]` + e - 1
        (`before` empty, or -1 for a row without drafts: none)."""
        ...


# Byte -> its 8 bits, least significant first (a mask's byte b holds tokens 8b..8b+7, on a little-endian host).
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1).bool()


def disallowed_tokens(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """[m, vocab] bool on `device`: True where mask row j (int32 words, bit t % 32 of word t // 32 set =
    token t allowed) disallows token t; token ids past the mask are disallowed. On CPU one numpy unpack of
    the inverted words; elsewhere a byte-to-bits table on the device."""
    words = bitmask.to(torch.int32).contiguous()
    covered = words.shape[1] * 32
    if device.type == "cpu":
        bits = np.unpackbits((~words.numpy()).view(np.uint8), axis=1, count=min(vocab, covered), bitorder="little")
        out = torch.from_numpy(bits).view(torch.bool)
    else:
        table = _BYTE_BITS if _BYTE_BITS.device == device else _BYTE_BITS.to(device)
        allowed = table[words.to(device).view(torch.uint8).long()].view(words.shape[0], -1)[:, :vocab]
        out = ~allowed
    if covered < vocab:
        out = torch.nn.functional.pad(out, (0, vocab - covered), value=True)
    return out.to(device)


def mask_rows_(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """The mask step, in place: row `rows[j]` of `logits` [b, vocab] gets the tokens that `bitmask[j]`
    disallows at -inf (rows ascending)."""
    disallowed = disallowed_tokens(bitmask, logits.shape[-1], logits.device)
    if len(rows) == logits.shape[0]:  # every row (ascending: in order)
        logits.masked_fill_(disallowed, float("-inf"))
        return
    for j, row in enumerate(rows):  # row views: no copy of the rows
        logits[row].masked_fill_(disallowed[j], float("-inf"))


def apply_token_masks(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [b, vocab] with the tokens that row `rows[j]`'s mask (`bitmask[j]`) disallows at -inf, as a
    new tensor (mask_rows_ on a copy)."""
    masked = logits.clone()
    mask_rows_(masked, rows, bitmask)
    return masked


def outside_masks(chosen: torch.Tensor, rows: Sequence[int], words: np.ndarray[Any, Any]) -> list[bool]:
    """Whether each masked row's chosen token (`chosen[rows[j]]`) is one its mask (`words[j]`, int32) disallows."""
    tokens = chosen[list(rows)].cpu().numpy().astype(np.int64)
    inside = tokens // 32 < words.shape[1]
    word = words[np.arange(len(rows)), np.minimum(tokens // 32, words.shape[1] - 1)].astype(np.int64)
    allowed = inside & (((word >> (tokens % 32)) & 1) == 1)
    refused: list[bool] = (~allowed).tolist()
    return refused


def draft_mask_rows(draft_counts: Sequence[int], first: int, capacity: int | None = None) -> list[int]:
    """`TokenMasks.fill`'s `before` for masked rows carrying `draft_counts` drafts (in masked order): each
    drafted row's draft-position masks in the rows from `first` on, one row after the other; -1 for a row
    without drafts. Raises ValueError past `capacity` rows (the tables' draft-mask rows)."""
    out, used = [], 0
    for e in draft_counts:
        out.append(first + used if e else -1)
        used += e
    if capacity is not None and used > capacity:
        raise ValueError(f"{used} draft positions of constrained rows exceed the {capacity} mask rows for them")
    return out
