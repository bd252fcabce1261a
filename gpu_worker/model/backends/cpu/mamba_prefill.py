"""The Mamba mixer's prefill on CPU in a C kernel (mamba_prefill.c): the SSD scan as the plain recurrence, in
place of the chunked GEMM form (packed_scan), and the causal conv in one pass, in place of packed_causal_conv's
dozen torch ops.

Why. The chunked form turns the scan into GEMMs, which is what a GPU wants. On CPU, at a scan chunk of 32
tokens, those GEMMs are small and many: about 40 torch ops a layer, and for one 136-token prompt of the
benchmark model (6 Mamba layers, 8 heads of 64, state 64) 5.2 ms of a 23 ms step. The recurrence itself,
token after token, reads and writes one head's state (16 KB) from L1 per token and needs fewer
multiply-adds than the chunked form; in C it is one call a layer. The conv is a few multiply-adds per value,
and its cost in torch was the ops around them.

How. `load()` builds the kernels with the machine's C compiler (gpu_worker.model.backends.cpu.native) and
returns False where it cannot; the mixer then keeps packed_scan and packed_causal_conv. `sequential_scan` has
`packed_prefill.PackedScan`'s contract, the state before every scan chunk included (only when the prefix
cache wants boundary states: `chunk_states=True`). With enough work the heads are split between threads
(ctypes releases the interpreter lock for the call). `causal_conv` has packed_causal_conv's contract.

Numerics. The scan: the same equations as the chunked scan, summed in another order, so float32 results
agree to rounding (tests/model/test_mamba_prefill.py compares it with packed_scan and the per-sequence
oracle); the per-token log-decay is clamped at packed_scan.LOG_FLOOR, as there. The conv: F.conv1d's sums
bit for bit, as packed_causal_conv's."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gpu_worker.model.backends.cpu import native
from gpu_worker.model.backends.cpu.packed_prefill import PackedScan
from gpu_worker.model.backends.cpu.packed_scan import LOG_FLOOR

SOURCE = Path(__file__).with_name("mamba_prefill.c")
_POINTER, _INTEGER = ctypes.c_void_p, ctypes.c_int64
SIGNATURE = (
    (*[_POINTER] * 8, *[_INTEGER] * 5, _POINTER, _POINTER, _INTEGER, ctypes.c_float, _INTEGER, _INTEGER),
    ctypes.c_int,
)
# tokens x heads per thread below which a second thread does not pay for its hand-off (one layer of 8 heads,
# two threads against one: 4 prompts of 2,000 tokens 12.2 against 15.0 ms, 32 prompts of 16..256 9.5
# against 10.5 ms, one prompt of 136 tokens 0.33 against 0.29 ms)
MIN_TOKEN_HEADS_PER_THREAD = 4096
CONV_SIGNATURE = ((_POINTER, _INTEGER, _POINTER, _POINTER, _POINTER, _INTEGER, _POINTER, _POINTER, *[_INTEGER] * 3,
                   _POINTER), ctypes.c_int)  # fmt: skip


def load() -> bool:
    """Builds and loads the kernels once per process; whether they are there."""
    return (
        native.kernel(SOURCE, "ssd_prefill_scan", *SIGNATURE) is not None
        and native.kernel(SOURCE, "causal_conv", *CONV_SIGNATURE) is not None
    )


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prefill-scan")


def sequential_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    initial: torch.Tensor, lengths: Sequence[int], chunk_size: int, chunk_states: bool = False,
    threads: int | None = None,
) -> PackedScan:  # fmt: skip
    """x [Tp, H, P], dt [Tp, H] (softplus'd, clamped), A [H], B/C [Tp, G, N], D [H], initial [S, H, P, N]
    (each span's state before it; the spans' tokens one after the other, `lengths` of them) -> PackedScan.
    `chunk_states`: also the state before every `chunk_size`-token chunk of each span (span-major), else
    that field is an empty tensor. `threads`: torch's intra-op threads unless given."""
    kernel = native.kernel(SOURCE, "ssd_prefill_scan", *SIGNATURE)
    if kernel is None:
        raise RuntimeError("the prefill scan kernel is not built (mamba_prefill.load())")
    tokens, heads, channels = x.shape
    groups, size = B.shape[1], B.shape[2]
    if sum(lengths) != tokens:
        raise ValueError(f"span lengths {list(lengths)} do not add up to the {tokens} prefill rows")
    x = x.float().contiguous()
    dt = dt.float().contiguous()
    a = A.float().contiguous()
    B, C, D = B.float().contiguous(), C.float().contiguous(), D.float().contiguous()
    states = initial.float().contiguous().clone()
    y = torch.empty_like(x)
    num_chunks = sum(-(-n // chunk_size) for n in lengths)
    starts = x.new_empty((num_chunks, heads, channels, size) if chunk_states else (0,))
    spans = torch.tensor(list(lengths), dtype=torch.int64)
    run = functools.partial(
        kernel, x.data_ptr(), dt.data_ptr(), a.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(),
        states.data_ptr(), spans.data_ptr(), len(lengths), heads, channels, size, groups,
        y.data_ptr(), starts.data_ptr() if chunk_states else None, chunk_size, LOG_FLOOR,
    )  # fmt: skip
    threads = torch.get_num_threads() if threads is None else threads
    parts = max(1, min(threads, heads, tokens * heads // MIN_TOKEN_HEADS_PER_THREAD))
    bounds = [heads * i // parts for i in range(parts + 1)]
    others = [_pool(parts - 1).submit(run, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True)]
    failed = [run(bounds[0], bounds[1]), *(other.result() for other in others)]
    if any(failed):
        raise MemoryError("the prefill scan kernel could not allocate its state buffer")
    return PackedScan(y=y, chunk_start_states=starts, final_states=states)


def causal_conv(
    xbc: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    slots: torch.Tensor, lengths: Sequence[int],
) -> torch.Tensor:  # fmt: skip
    """packed_causal_conv's contract: xbc [Tp, conv_dim] (pre-conv; rows may be strided, as a column slice of
    in_proj's output), weight [conv_dim, 1, K], conv_state [rows, conv_dim, K-1] float32 (updated at `slots`,
    the spans' pool rows, in span order; `lengths` their tokens) -> the conv's output [Tp, conv_dim] float32,
    before the activation."""
    kernel = native.kernel(SOURCE, "causal_conv", *CONV_SIGNATURE)
    if kernel is None:
        raise RuntimeError("the causal conv kernel is not built (mamba_prefill.load())")
    tokens, channels = xbc.shape
    width = weight.shape[-1]
    if sum(lengths) != tokens or len(lengths) != slots.numel():
        raise ValueError(f"span lengths {list(lengths)} and {slots.numel()} slots do not fit {tokens} prefill rows")
    if conv_state.dtype != torch.float32 or conv_state.stride()[1:] != (width - 1, 1):
        raise ValueError(f"conv_state must be float32, rows contiguous: {conv_state.dtype} {conv_state.stride()}")
    x = xbc if xbc.dtype == torch.float32 and xbc.stride(1) == 1 else xbc.float().contiguous()
    taps = weight[:, 0, :].t().float().contiguous()  # [K, C]
    b = bias.float().contiguous() if bias is not None else None
    slots, spans = slots.to(torch.int64).contiguous(), torch.tensor(list(lengths), dtype=torch.int64)
    out = torch.empty(tokens, channels, dtype=torch.float32)
    failed = kernel(x.data_ptr(), x.stride(0), taps.data_ptr(), b.data_ptr() if b is not None else None,
                    conv_state.data_ptr(), conv_state.shape[0], slots.data_ptr(), spans.data_ptr(), len(lengths),
                    channels, width, out.data_ptr())  # fmt: skip
    if failed:
        raise IndexError(f"state slots {slots.tolist()} outside the pool's {conv_state.shape[0]} rows")
    return out
