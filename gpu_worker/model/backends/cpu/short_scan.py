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

from collections.abc import Callable
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
        upto = _upto(torch.tensor(ends, device=self.a.device), self.a.shape[-1])  # [R, L]
        a, xdt = self.a[rows] * upto[:, None, :], self.xdt[rows] * upto[:, None, :, None]
        return final_states(a, xdt, self.B[rows], self.initial[rows])


def _upto(ends: torch.Tensor, length: int) -> torch.Tensor:
    """[R, L] float32: 1 at the steps up to ends[r], 0 after (those steps are then taken out of a span)."""
    return (torch.arange(length, device=ends.device)[None, :] <= ends[:, None]).float()


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


@dataclass(frozen=True, slots=True)
class StackedSpanRecord:
    """What the compiled verify program (gpu_worker.model.backends.cpu.decode_program.verify_logits) leaves
    for a rollback: ShortSpanRecord's contents for every Mamba layer at once, stacked on a leading layer
    dimension, over the state pool's stacked storage; `restore` runs `restore_rows` through `program` (its
    compiled form, gpu_worker.model.backends.cpu.compiled_step: a few fused loops whatever the number of
    layers, where a ShortSpanRecord a layer cost 1.1 ms for 6 layers, one row)."""

    conv_state: torch.Tensor  # [layers, rows, conv_dim, K-1]
    ssm_state: torch.Tensor  # [layers, rows, H, P, N]
    slots: tuple[int, ...]  # span i's state slot
    initial: torch.Tensor  # [layers, S, H, P, N]
    a: torch.Tensor  # [layers, S, H, L]
    xdt: torch.Tensor  # [layers, S, H, L, P]
    B: torch.Tensor  # [layers, S, H, L, N]
    windows: torch.Tensor  # [layers, S, conv_dim, K-1+L]
    program: Callable[..., None]  # restore_rows, or its compiled form

    def restore(self, slots: list[int], ends: list[int]) -> None:
        """Each slot's conv and SSM state, in every layer, to those after its span's token ends[r]."""
        device = self.a.device
        with torch.inference_mode():  # the index tensors as the program was compiled on
            rows = torch.tensor([self.slots.index(slot) for slot in slots], device=device)
            ends_t, target = torch.tensor(ends, device=device), torch.tensor(slots, device=device)
        self.program(
            self.conv_state, self.ssm_state, self.initial, self.a, self.xdt, self.B, self.windows, rows, ends_t, target
        )  # fmt: skip


def restore_rows(
    conv_state: torch.Tensor, ssm_state: torch.Tensor, initial: torch.Tensor, a: torch.Tensor, xdt: torch.Tensor,
    B: torch.Tensor, windows: torch.Tensor, rows: torch.Tensor, ends: torch.Tensor, target: torch.Tensor,
) -> None:  # fmt: skip
    """StackedSpanRecord's rollback, no host decision: slot target[r] of every layer of conv_state and
    ssm_state to the state after token ends[r] of span rows[r]: the span's recurrence with its tokens after
    ends[r] taken out (dt = 0 leaves a state as it is), and its window cut there."""
    upto = _upto(ends, a.shape[-1])  # [R, L]
    a = a.index_select(1, rows) * upto[:, None, :]
    xdt = xdt.index_select(1, rows) * upto[:, None, :, None]
    states = final_states(a, xdt, B.index_select(1, rows), initial.index_select(1, rows))
    ssm_state.index_copy_(1, target, states.to(ssm_state.dtype))
    layers, _, channels, keep = conv_state.shape
    columns = ends[:, None] + 1 + torch.arange(keep, device=ends.device)[None, :]  # [R, K-1]
    pick = columns[None, :, None, :].expand(layers, rows.shape[0], channels, keep)
    conv_state.index_copy_(1, target, windows.index_select(1, rows).gather(3, pick))


def final_states(a: torch.Tensor, xdt: torch.Tensor, B: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
    """[..., H, P, N]: the state after the last of the L steps of a [..., H, L] (dt * A), xdt [..., H, L, P]
    and B [..., H, L, N] from `initial` [..., H, P, N] (a step with a = xdt = 0 leaves it as it is)."""
    to_end = torch.exp(_segment_sum(a))[..., -1, :]  # [..., H, u]: exp(a_{u+1} + .. + a_{L-1})
    return torch.exp(a.sum(-1))[..., None, None] * initial + (xdt * to_end[..., None]).transpose(-1, -2) @ B


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
    start = initial.float()
    y, final, a, xdt = scan_spans(xs, dts, Bs, Cs, A, D, start)
    return y.transpose(1, 2)[valid], final, ShortSpans(start, a, xdt, Bs)


def scan_spans(
    xs: torch.Tensor, dts: torch.Tensor, Bs: torch.Tensor, Cs: torch.Tensor, A: torch.Tensor, D: torch.Tensor,
    initial: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The closed form on spans laid out [S, H, L, ...]: xs [S, H, L, P], dts [S, H, L] (0 on padded steps),
    Bs/Cs [S, H, L, N] float32, A/D [H], initial [S, H, P, N] float32 -> (y [S, H, L, P] float32 with the D
    skip, the final states [S, H, P, N], a [S, H, L] and xdt [S, H, L, P]: with `initial` and Bs, what
    `ShortSpans.state_at` rebuilds any state from). No host decision: the compiled verify program
    (gpu_worker.model.backends.cpu.decode_program) calls it too."""
    a = dts * A.float()[None, :, None]  # [S, H, L]
    decay = torch.exp(_segment_sum(a))  # [S, H, t, u]
    xdt = xs * dts[..., None]
    y = (Cs @ Bs.transpose(-1, -2) * decay) @ xdt  # within the spans
    y = y + torch.exp(torch.cumsum(a, dim=-1))[..., None] * (Cs @ initial.transpose(-1, -2))  # from the start states
    y = y + xs * D.float()[None, :, None, None]
    return y, final_states(a, xdt, Bs, initial), a, xdt  # padded steps keep the state: L-1 is every span's end
