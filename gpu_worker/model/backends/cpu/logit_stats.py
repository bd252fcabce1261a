"""The sampler's argmax and log-normaliser of float32 logit rows in one kernel (logit_stats.c).

Why. A plain row (greedy, no alternatives asked for) needs its first maximal token and that token's
log-probability, logit - logsumexp(row). In torch that was a log_softmax over the whole row (written out,
then one element read back) and an argmax (unvectorised on CPU): at a 100,352-token vocabulary, 8 rows, one
thread, 0.46 ms and 0.68 ms. The kernel reads each row three times while it stays in cache and writes two
numbers. `sampling.sample_rows` over plain rows of that vocabulary, one thread, AMD EPYC, ms, torch against
the kernel: 1 row 0.165 / 0.056, 8 rows 1.255 / 0.269, 32 rows 5.539 / 1.172; at the benchmark model's
512 tokens both take 0.02-0.04 ms.

`load()` builds it once per process (gpu_worker.model.backends.cpu.native); `stats(logits)` runs it, or
torch's argmax and logsumexp where it cannot be built or the tensor is not a CPU float32 one. The compiled
decode programs call it as a custom op (`hybridserve::logit_stats`, decode_program.decode_tokens), so a
plain row's token is chosen inside the program and the sampler only reads it."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from gpu_worker.model.backends.cpu import native

SOURCE = Path(__file__).with_name("logit_stats.c")

SIGNATURE = ((ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p), None)


def load() -> Any:
    """The kernel, built and loaded once per process; None where it cannot be."""
    return native.kernel(SOURCE, "logit_stats", *SIGNATURE)


def stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, vocab] -> (each row's first maximal index [b] int64, its logsumexp [b] float32). The first
    call on CPU builds the kernel where no earlier one did (the runner's warm-up samples, so no served step
    does)."""
    kernel = load() if logits.device.type == "cpu" else None
    if (
        kernel is None
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
        or logits.shape[1] == 0
    ):
        return logits.argmax(dim=-1), torch.logsumexp(logits.float(), dim=-1)
    rows = logits.shape[0]
    argmax = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32)
    kernel(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), argmax.data_ptr(), lse.data_ptr())
    return argmax, lse


@torch.library.custom_op("hybridserve::logit_stats", mutates_args=())
def logit_stats_op(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`stats` as an op a compiled program calls (an extern call inductor leaves as it is)."""
    return stats(logits)


@logit_stats_op.register_fake
def _(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.float32)
