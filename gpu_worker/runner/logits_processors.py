"""The logits processors of a step's sampling, in vLLM's order (`PIPELINE`): what gpu_worker.runner.sampling's
`sample_rows` applies to the rows that need more than the argmax.

- `apply_controls`: the per-request controls (logit_bias, the min_tokens mask, repetition_penalty,
  presence and frequency penalties), in place, as scatters and gathers at the token ids concerned.
- `filter_logits`: temperature, min-p, top-k and top-p (excluded tokens at -inf), before the draw.
- `choose_masked`: the token of a grammar-constrained row (gpu_worker.runner.token_masks) that chose outside
  its mask, chosen again among the tokens the mask allows, with the same random draw.
- `has_filters`: whether a sampled row's filters read its whole distribution (such a row is masked before
  them, not after its choice)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gpu_worker.runner.token_masks import disallowed_tokens

if TYPE_CHECKING:
    from gpu_worker.runner.sampling import SamplingParams

SPARSE_MASK_SHARE = 4  # a mask with at most 1/4 of its words non-zero is chosen from by a gather


def choose_masked(
    row: torch.Tensor, words: np.ndarray[Any, Any], drawn: tuple[int, SamplingParams] | None, noise: torch.Tensor
) -> torch.Tensor:
    """The token of one masked row without filters, from its logits `row` [vocab] (a view: written in
    place) and its mask `words`: the best allowed token, or, for a sampled row (`drawn`: its index into
    `noise` and its params), the race's winner among the allowed tokens with its noise. A mask that allows
    few tokens (a grammar between structural tokens) is chosen from at the allowed ids alone; a wider one
    puts the others at -inf first (an empty mask too: the row's logits then all -inf, as if masked first). The
    same tokens either way."""
    vocab = row.shape[0]
    nonzero = np.flatnonzero(words)  # the words that allow some token
    if 0 < len(nonzero) <= len(words) // SPARSE_MASK_SHARE:
        bits = np.unpackbits(words[nonzero].view(np.uint8), bitorder="little").reshape(len(nonzero), 32)
        allowed = (nonzero[:, None] * 32 + np.arange(32))[bits.astype(bool)]  # ascending
        ids = torch.from_numpy(allowed[allowed < vocab]).to(row.device)
        if len(ids):
            values = row[ids]
            if drawn is None:
                return ids[values.argmax()]
            k, params = drawn
            probs = filter_logits(values[None, :], [params]).softmax(dim=-1)[0]
            return ids[(probs / noise[k, ids]).argmax()]
    row.masked_fill_(disallowed_tokens(torch.from_numpy(words[None, :]), vocab, row.device)[0], float("-inf"))
    if drawn is None:
        return row.argmax()
    k, params = drawn
    probs = filter_logits(row[None, :], [params]).softmax(dim=-1)[0]
    return (probs / noise[k]).argmax()


def has_filters(p: SamplingParams, vocab: int) -> bool:
    """A sampled row whose filters (min-p, top-k, top-p) depend on the whole distribution: masking it
    after the draw would change which tokens the filters keep."""
    return p.temperature != 0.0 and (p.min_p > 0.0 or 0 < p.top_k < vocab or p.top_p < 1.0)


def apply_controls(
    logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
    history: tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | None,
) -> None:  # fmt: skip
    """The per-request controls, in place, on `logits` [b, vocab] at `rows` (one per `params`; `history`
    (HistoryTables.rows) one row per params that needs_history, in order), vLLM's order: logit_bias (added
    to the raw logits), the min_tokens mask (held ids at -inf), repetition_penalty (transformers': a seen
    token's logit divided by it when positive, multiplied when not), frequency and presence penalties
    (OpenAI's: logit - frequency * count - presence * (count > 0), over the generated tokens). Every
    control is a scatter or a gather-and-scatter at the ids concerned: nothing reads the whole vocabulary."""
    device = logits.device
    bias = [(rows[j], t, b) for j, p in enumerate(params) for t, b in p.logit_bias]
    if bias:
        r, t, b = zip(*bias, strict=True)
        index = (torch.tensor(r, device=device), torch.tensor(t, device=device))
        logits.index_put_(index, torch.tensor(b, device=device, dtype=logits.dtype), accumulate=True)
    with_history = [j for j, p in enumerate(params) if p.needs_history]
    if not with_history:
        return
    assert history is not None and len(history[3]) == len(with_history)
    ids, counts, valid, generated = history
    held = [
        (rows[j], t) for j, n in zip(with_history, generated, strict=True) if n < params[j].min_tokens
        for t in params[j].held_token_ids
    ]  # fmt: skip
    if held:
        r, t = zip(*held, strict=True)
        logits[torch.tensor(r, device=device), torch.tensor(t, device=device)] = float("-inf")
    hp = [params[j] for j in with_history]
    if not any(p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in hp):
        return
    at = torch.tensor([rows[j] for j in with_history], device=device)[:, None].expand_as(ids)
    values = logits[at, ids]  # [k, u]: the logits of the tokens each row has seen
    if any(p.repetition_penalty != 1.0 for p in hp):
        rep = torch.tensor([p.repetition_penalty for p in hp], device=device, dtype=values.dtype)[:, None]
        values = torch.where(values > 0, values / rep, values * rep)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in hp):
        freq = torch.tensor([p.frequency_penalty for p in hp], device=device, dtype=values.dtype)[:, None]
        pres = torch.tensor([p.presence_penalty for p in hp], device=device, dtype=values.dtype)[:, None]
        values = values - freq * counts - pres * (counts > 0).to(values.dtype)
    logits[at[valid], ids[valid]] = values[valid]  # each (row, id) once: the ids of a row are distinct


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The pipeline's filters on rows [b, vocab]: temperature, min-p, top-k and top-p -> logits with
    excluded tokens at -inf (the per-request controls ran before: apply_controls)."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
    logits = logits / temps[:, None]
    if any(p.min_p > 0.0 for p in params):  # vLLM's: below min_p times the best token's probability
        probs = logits.softmax(dim=-1)
        floor = torch.tensor([p.min_p for p in params], device=device, dtype=torch.float32)[:, None]
        logits = logits.masked_fill(probs < floor * probs.amax(dim=-1, keepdim=True), float("-inf"))
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


# the order apply_token_masks, apply_controls, filter_logits and sample_rows apply them
PIPELINE = (
    "grammar_mask", "logit_bias", "min_tokens", "repetition_penalty", "presence_frequency_penalty", "temperature",
    "min_p", "top_k", "top_p", "draw",
)  # fmt: skip
