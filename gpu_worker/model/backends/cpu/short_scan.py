"""The SSD scan of short spans (a verify row of speculative decoding: the newest token and its drafts),
and the state after any of their tokens on demand.

A span of a few tokens through the chunked scan is padded to a whole scan chunk (the model's, e.g. 256
tokens): its [Q x Q] decay matrices cost as much as a chunk of prompt, and a state inside the span takes
one more scan each (gpu_worker.model.boundary_states). For spans of at most SHORT_SPAN_TOKENS tokens the
recurrence is unrolled in closed form instead, all spans at once, padded only to the longest:

    S_t = exp(a_1 + .. + a_t) S_0 + sum_{u <= t} exp(a_{u+1} + .. + a_t) dt_u x_u (outer) B_u
    y_t = S_t @ C_t + D x_t = exp(a_1 + .. + a_t) C_t S_0 + sum_{u <= t} exp(..) (C_t . B_u) dt_u x_u + D x_t

(a_t = dt_t * A, as in gpu_worker.model.ssd, with its exact segment sums). Only y and the final states
are formed: every token's state would be [S, H, L, P, N] floats written and read again, which on CPU
costs more than the rest of the verify step. The inputs are kept instead (`ShortSpans`): the state
after token m of span i is rebuilt from them when asked (`state_at`), for a block boundary inside a
short chunk here, and by speculation's rollback for a row whose drafts were not all accepted. Padded
steps have dt = 0 and leave the state as it is."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.model.ssd import _segment_sum

SHORT_SPAN_TOKENS = 8  # the longest span the closed form takes; longer ones take the chunked scan
RECORDS_KEY = "short_spans"  # ForwardContext.derived: a list that collects each Mamba layer's ShortSpanRecord


@dataclass(frozen=True, slots=True)
class ShortSpans:
    """One layer's short spans, as the scan saw them: [S, H, ...] per span and head."""

    initial: torch.Tensor  # [S, H, P, N] float32: the states before the spans
    a: torch.Tensor  # [S, H, L]: dt * A per token (0 on padded steps)
    xdt: torch.Tensor  # [S, H, L, P]: dt * x
    B: torch.Tensor  # [S, H, L, N]

    def state_at(self, i: int, m: int) -> torch.Tensor:
        """[H, P, N] float32: span i's state after its token m (0-based)."""
        return self.states_at([i], [m])[0]

    def states_at(self, spans: list[int], ends: list[int]) -> torch.Tensor:
        """[R, H, P, N] float32: span spans[r]'s state after its token ends[r], all in one product."""
        rows = torch.tensor(spans, device=self.a.device)
        last = torch.tensor(ends, device=self.a.device)
        a = self.a[rows]  # [R, H, L]
        pick = last[:, None, None, None].expand(-1, a.shape[1], 1, a.shape[2])
        weights = torch.exp(_segment_sum(a).gather(2, pick)[:, :, 0])  # [R, H, u]: exp(a_{u+1} + .. + a_m), 0 past m
        cum = torch.cumsum(a, dim=-1).gather(2, last[:, None, None].expand(-1, a.shape[1], 1))[..., 0]  # [R, H]
        carried = torch.exp(cum)[..., None, None] * self.initial[rows]
        return carried + (self.xdt[rows] * weights[..., None]).transpose(-1, -2) @ self.B[rows]


@dataclass(frozen=True, slots=True)
class ShortSpanRecord:
    """What a forward leaves of one Mamba layer's short spans for a rollback: the layer's pool tensors,
    each span's state slot, its inputs, and its conv window ([conv_dim, K-1+L]: the conv state before it,
    then its pre-conv inputs; the conv state after token m is window[:, m+1 : m+K])."""

    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    slots: tuple[int, ...]
    spans: ShortSpans
    windows: tuple[torch.Tensor, ...]

    def restore(self, slots: list[int], ends: list[int]) -> None:
        """Each slot's conv and SSM state to those after its span's token ends[r]."""
        spans = [self.slots.index(slot) for slot in slots]
        keep = self.conv_state.shape[-1]
        for slot, i, m in zip(slots, spans, ends, strict=True):
            self.conv_state[slot] = self.windows[i][:, m + 1 : m + 1 + keep]
        states = self.spans.states_at(spans, ends).to(self.ssm_state.dtype)
        self.ssm_state.index_copy_(0, torch.tensor(slots, device=states.device), states)


def short_spans_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    initial: torch.Tensor, lengths: list[int],
) -> tuple[torch.Tensor, torch.Tensor, ShortSpans]:  # fmt: skip
    """x [Tp, H, P], dt [Tp, H] (softplus'd, clamped), A [H], B/C [Tp, G, N], D [H], initial [S, H, P, N]
    for spans of `lengths` packed in order -> (y [Tp, H, P] float32 with the D skip, the final states
    [S, H, P, N] float32, the inputs for `ShortSpans.state_at`)."""
    num_heads = x.shape[1]
    per_group = num_heads // B.shape[1]
    longest = max(lengths)
    steps = torch.arange(longest, device=x.device)
    starts = torch.tensor([0, *lengths[:-1]], device=x.device).cumsum(0)
    counts = torch.tensor(lengths, device=x.device)
    index = starts[:, None] + torch.minimum(steps[None, :], counts[:, None] - 1)  # [S, L] packed row of (s, t)
    valid = steps[None, :] < counts[:, None]  # [S, L]
    # every tensor [S, H, L, ...]: per (sequence, head) the recurrence is [L x L] lower-triangular products
    xs = x.float()[index].transpose(1, 2)  # [S, H, L, P]
    dts = (dt.float()[index] * valid[..., None]).transpose(1, 2)  # [S, H, L]; padded steps: dt = 0
    Bs = B.float()[index].repeat_interleave(per_group, dim=2).transpose(1, 2)  # [S, H, L, N]
    Cs = C.float()[index].repeat_interleave(per_group, dim=2).transpose(1, 2)
    a = dts * A.float()[None, :, None]  # [S, H, L]
    decay = torch.exp(_segment_sum(a))  # [S, H, t, u]
    xdt = xs * dts[..., None]
    start = initial.float()
    y = (Cs @ Bs.transpose(-1, -2) * decay) @ xdt  # within the spans
    y = y + torch.exp(torch.cumsum(a, dim=-1))[..., None] * (Cs @ start.transpose(-1, -2))  # from the start states
    y = y + xs * D.float()[None, :, None, None]
    to_end = decay[:, :, -1, :]  # [S, H, u]: padded steps keep the state, so row L-1 is every span's end
    final = torch.exp(a.sum(-1))[..., None, None] * start + (xdt * to_end[..., None]).transpose(-1, -2) @ Bs
    return y.transpose(1, 2)[valid], final, ShortSpans(start, a, xdt, Bs)
