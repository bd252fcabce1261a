"""The SSM state's decode update in place, a small C kernel (ssm_update.c) the compiled decode programs call.

Why. A decode program must read and advance the state rows of its batch's slots, which are anywhere in
the pool. Written in torch (`index_select`, the update, `index_copy_`), inductor keeps the gathered rows
and the new state in buffers of their own: per Mamba layer seven passes over the batch's state (gather,
copy, readout, update, scatter) where one read and one write would do. At 32 rows of the benchmark model
that was about 8 ms of a 17 ms program, more than the projections; inductor will not fuse a read and a
write of the same buffer at indirect rows into one loop. This kernel reads each state row once, computes
the readout from it and writes the advanced row over it.

How. `load()` builds the C file with the machine's C compiler and loads it with ctypes (gpu_worker.model.
backends.cpu.native); it returns False (the programs keep the torch form) where no compiler or build
works. `torch.ops.hybridserve.ssm_decode_update` is the kernel as a custom op that mutates the pool, so
inductor calls it in place from the program's wrapper (an extern call, like the oneDNN projections).

Padding. A program's bucket repeats its first real row's slot in the padding rows before it
(compiled_step): the kernel writes a slot only at its last occurrence, so that real row advances the
state once, from the old state, and the padding rows only read it."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from gpu_worker.model.backends.cpu import native

SOURCE = Path(__file__).with_name("ssm_update.c")

_POINTER, _INTEGER = ctypes.c_void_p, ctypes.c_int64
SIGNATURE = ((_POINTER, _INTEGER, _INTEGER, _POINTER, *[_INTEGER] * 5, *[_POINTER] * 7), ctypes.c_int)
_kernel: Any = None
LOADED = False  # whether the kernel is loaded: decode_program reads it when traced


def load() -> bool:
    """Builds and loads the kernel once per process (gpu_worker.model.backends.cpu.native); whether it is
    there."""
    global _kernel, LOADED
    _kernel = native.kernel(SOURCE, "ssm_decode_update", *SIGNATURE)
    LOADED = _kernel is not None
    return LOADED


@torch.library.custom_op("hybridserve::ssm_decode_update", mutates_args=("ssm",))
def ssm_decode_update(
    ssm: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    decay: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """ssm [rows, H, P, N] float32 (each row contiguous), updated at rows `slots` [b] int64; x [b, H, P], dt
    and decay [b, H], B and C [b, G, N], D [H], float32 -> y [b, H, P] (ssm_update.c's equations)."""
    if _kernel is None:
        raise RuntimeError("the SSM update kernel is not loaded (ssm_update.load())")
    b, heads, channels = x.shape
    groups, size = B.shape[1], B.shape[2]
    if ssm.dtype != torch.float32 or ssm.stride()[1:] != (channels * size, size, 1):
        raise ValueError(f"ssm must be float32 with contiguous rows, got {ssm.dtype} strides {ssm.stride()}")
    slots, x, dt, decay = slots.contiguous(), x.contiguous(), dt.contiguous(), decay.contiguous()
    B, C, D = B.contiguous(), C.contiguous(), D.contiguous()
    y = torch.empty(b, heads, channels, dtype=torch.float32)
    failed = _kernel(
        ssm.data_ptr(), ssm.shape[0], ssm.stride(0), slots.data_ptr(), b, heads, channels, size, groups,
        x.data_ptr(), dt.data_ptr(), decay.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(), y.data_ptr(),
    )  # fmt: skip
    if failed:
        raise IndexError(f"state slots {slots.tolist()} outside the pool's {ssm.shape[0]} rows")
    return y


@ssm_decode_update.register_fake
def _(ssm: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor,
      B: torch.Tensor, C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return x.new_empty(x.shape, dtype=torch.float32)
