"""Mamba state at block boundaries inside a prefill chunk, taken from the chunked scan.

The SSD scan already computes the state after every scan chunk (`ssd_scan(chunk_states_out=...)`).
A boundary on that grid reads its row; any other boundary runs the scan over the few tokens between
the last scan-chunk state and the boundary (fewer than one scan chunk), so every block boundary a
chunk crosses yields its state whatever the grid, at the cost of at most one short scan. The conv
state at offset o is the window of the last d_conv - 1 pre-conv inputs before token o.

Kept apart from the mixer so the reference path (mamba2.py) and the kernel path (backends/cuda/ops.py)
share it."""

from __future__ import annotations

import torch

from gpu_worker.model.context import BoundaryState
from gpu_worker.model.ssd import ssd_scan


def save_boundary_states(
    points: tuple[BoundaryState, ...],
    window: torch.Tensor,
    scan_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    chunk_states: torch.Tensor,
    chunk_size: int,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> None:
    """Writes each point's state into its pool row.

    window [conv_dim, K-1+L]: the span's conv state before the chunk followed by its pre-conv inputs;
    scan_inputs (x [L, H, P], dt [L, H], A [H], B [L, G, N], C [L, G, N], D [H]) as given to ssd_scan;
    chunk_states [c+1, H, P, N] from ssd_scan's chunk_states_out; conv_state / ssm_state this layer's
    pool tensors, indexed by storage row."""
    keep = conv_state.shape[-1]  # K - 1
    x, dt, A, B, C, D = scan_inputs
    for point in points:
        offset = point.offset
        conv_state[point.row] = window[:, offset : offset + keep]
        k, rest = divmod(offset, chunk_size)
        if rest == 0:
            ssm_state[point.row] = chunk_states[k]
            continue
        part = slice(k * chunk_size, offset)  # the tokens after the last scan-chunk state
        _, state = ssd_scan(x[part], dt[part], A, B[part], C[part], D, chunk_states[k], chunk_size)
        ssm_state[point.row] = state
