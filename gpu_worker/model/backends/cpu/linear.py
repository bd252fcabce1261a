"""Dense projections on CPU through oneDNN instead of torch's default BLAS.

On CPU, `F.linear` in float32 runs MKL's sgemm, which takes its AVX2 path on AMD processors; oneDNN
(bundled with torch, reached through `torch.ops.mkldnn._linear_pointwise` on ordinary dense tensors)
uses AVX-512 there. Measured on one core of this project's AMD EPYC CI machine, float32, every
projection shape of the benchmark model (256 -> 1160 / 1024 / 256 / 128, 512 -> 256):

    rows      1      8     32    128    512   2048
    oneDNN  0.4-0.8x  0.6-1.3x  1.1-1.7x  1.7-2.1x  2.1-2.2x  2.2-2.3x  faster than F.linear

so a prefill step's projections (in_proj, out_proj, q/k/v/o, MLP: two thirds of its time) take less
than half as long, while a few-row decode keeps `F.linear`, whose per-call cost is lower. vLLM's CPU
build routes the same layers through oneDNN. Results differ from `F.linear` by float32 rounding only
(another summation order: ~2e-6 on values of order 1).

Prepacked weights. Given the weight as a plain dense tensor, oneDNN reorders it into its blocked layout on
every call, a third or more of a few-row call's cost. Reordered once (`torch.ops.mkldnn.
_reorder_linear_weight`) and kept beside the parameter, the same projection on one core, us per call
with the weight hot in cache:

    rows                       1      3      8     16     32    128   2048
    F.linear (MKL)            17     43     69    111    196    710  11150   (256 -> 1160)
    oneDNN, plain weight      25     43     54     72    112    331   4930
    oneDNN, prepacked         25     26     36     53     93    313   4730

and in a forward, where each weight is read once per step from the last-level cache (24 weights of one
shape in turn), us per call at 1 / 2 rows, F.linear against prepacked: 256 -> 1160 47.6 / 29.6 and
61.5 / 35.9, 256 -> 1024 40.1 / 26.5, 256 -> 512 23.0 / 18.7, 512 -> 256 17.2 / 18.7 and 23.6 / 19.5,
256 -> 256 11.3 / 14.2, 256 -> 128 7.4 / 12.1. So a decode step's projections take the pack from one
row on where the weight has at least PACK_FEW_ROWS_BYTES, from PACKED_MIN_ROWS rows on where it is
smaller (one call's fixed cost outweighs reading it). The pack is a private copy of the weight (model
processes share the parameters, not the packs), so it is made only while the model's projection
weights total at most PACK_MAX_BYTES (1 GiB, and a sixteenth of the host's memory: `pack_limit`); it
is rebuilt when the parameter's storage or version changes (a model process swaps its parameters for
the worker's shared ones after load).

bfloat16. Where oneDNN has a native bfloat16 path on these cores (`packs_dtype`: AVX-512 BF16 or AMX),
bfloat16 weights are packed too, and every row count takes the pack: F.linear in bfloat16 is oneDNN on
the plain weight, reordered on every call. One row / 8 rows, one thread, AMD EPYC, us, F.linear against
packed: 256 -> 1160 38.6 / 55.7 against 24.5 / 39.5, 768 -> 3080 192 / 315 against 126 / 206, the
100,352 x 768 LM head 17.4 / 21.5 ms against 11.1 / 11.2 ms. Elsewhere (float16, bfloat16 without the
native path) projections stay F.linear's.

`use_onednn_linears(model)` switches every plain `nn.Linear` of a model to `OneDnnLinear` in place
(same parameters, same state dict); the CPU runner calls it at load."""

from __future__ import annotations

import functools
import re
import threading
import typing
import weakref
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

# Fewest rows that go to oneDNN; below, F.linear's lower per-call cost wins (see the table above). A
# decode step of the benchmark model, one thread, ms (oneDNN from 32 rows / from 16 rows, 8-row
# buckets below 64), three rounds: 16 sequences 7.35-8.59 / 6.98-7.65, 24: 9.31-9.50 / 7.90-8.41,
# 8 and 12 (F.linear either way, or oneDNN from 8 rows: no better) unchanged.
ONEDNN_MIN_ROWS = 16
# With the weight prepacked, small weights go to oneDNN from this many rows, those of at least
# PACK_FEW_ROWS_BYTES from one (the tables above). Whole decode steps of the benchmark model, compiled Mamba
# step, ms, packed / unpacked (bench_decode --unpacked): 1 row 2.23 / 2.39, 2 rows 2.56 / 2.82, 4 rows
# 3.31 / 3.84, 8 rows 3.75 / 4.79, 16 rows 5.41 / 6.98, 32 rows 8.03 / 8.77.
PACKED_MIN_ROWS = 3
PACK_FEW_ROWS_BYTES = 512 << 10
# Where the weights are not packed (a model over PACK_MAX_BYTES), a float32 weight of at least this many
# bytes still goes to oneDNN from one row: MKL's few-row sgemv runs on one thread whatever torch's count,
# and on AMD cores on its AVX2 path. The 100k-vocabulary LM head (100,352 x 768, float32), one row, ms,
# F.linear against oneDNN on the plain weight: one thread 23.1 / 17.3, two threads 23.4 / 10.8; a 3,080 x
# 768 projection on two threads 0.181 / 0.096 (AMD EPYC, bench/RESULTS.md).
PLAIN_FEW_ROWS_BYTES = 2 << 20
# Where MKL's sgemm takes its AVX-512 path (Intel cores: `mkl_takes_avx512`), float32 weights under
# MKL_MAX_BYTES go to F.linear up to MKL_MAX_ROWS rows, packed or not: whole compiled decode steps of the
# benchmark model (all its weights under 2 MB), one thread, Intel Xeon (AVX-512, AMX), ms, oneDNN's packs
# against F.linear: 4 rows 4.27 / 3.08, 8 rows 5.24-5.49 / 4.04-4.31, 16 rows 8.39 / 6.72, 32 rows 14.28 /
# 12.0. Larger weights keep oneDNN (the 100k-vocabulary LM head at 8 rows on the same cores: 67.8 ms by
# F.linear, 36.5 ms by oneDNN), and so do AMD cores, where MKL runs its AVX2 path (the tables above).
MKL_MAX_BYTES = 2 << 20
MKL_MAX_ROWS = 32
# The most projection-weight bytes a model may have for its projections to be packed (one private copy
# per process that runs the model: the 6.4M-parameter benchmark model has 25 MB, the 100k-vocabulary one
# 0.5 GB in float32), and at most 1/PACK_HOST_SHARE of the host's memory (`pack_limit`). The 100k model in
# float32, two threads, compiled step, ms, unpacked against packed (AMD EPYC, bench_decode --preset 100k):
# 8 rows 38.66 / 32.09, 32 rows 91.61 / 68.74; one row 25.83 / 25.56 (the head reads as fast either way).
PACK_MAX_BYTES = 1 << 30
PACK_HOST_SHARE = 16
# The batch size the pack's layout is chosen for; packed for 64 rows it serves any row count (measured
# as fast as a pack made for the exact count, 8 rows: 35.6 vs 36.3 us).
PACK_ROWS_HINT = 64
# oneDNN builds (and caches) a kernel per input shape: the first call with a new row count costs
# 0.3-1 ms more per projection, ~10-20 ms for a forward of the benchmark model, and a serving step's row
# count (a prefill chunk plus the decoding rows) is new nearly every step. Rows are padded up to a
# multiple of ROW_BUCKET (of SMALL_ROW_BUCKET below SMALL_ROWS, where padding would cost most), so
# shapes repeat; up to EXACT_ROWS (a decode step's few rows, where a padded row costs most) not at all.
ROW_BUCKET = 16
SMALL_ROW_BUCKET = 8
SMALL_ROWS = 64
EXACT_ROWS = 8


def bucket_rows(rows: int) -> int:
    """The row count `rows` runs padded to (up to EXACT_ROWS, none: a decode step's few rows)."""
    if rows <= EXACT_ROWS:
        return rows
    step = SMALL_ROW_BUCKET if rows < SMALL_ROWS else ROW_BUCKET
    return -(-rows // step) * step


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its dense linear entry point."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")  # type: ignore[no-untyped-call]


@functools.cache
def mkl_takes_avx512() -> bool:
    """Whether MKL's sgemm runs its AVX-512 kernels here: an Intel CPU with AVX-512 (MKL picks its code
    path by vendor; on AMD cores it takes AVX2). Read from /proc/cpuinfo; False where that is missing."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            text = info.read(1 << 16)
    except OSError:
        return False
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.M)
    flags = re.search(r"^flags\s*:(.*)$", text, re.M)
    return bool(vendor and vendor.group(1) == "GenuineIntel" and flags and " avx512f" in flags.group(1))


@functools.cache
def packs_dtype(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` are packed for oneDNN: float32 always; bfloat16 where oneDNN has a native
    bfloat16 path on these cores (AVX-512 BF16 or AMX; elsewhere it would convert every call)."""
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class OneDnnLinear(nn.Linear):
    """An `nn.Linear` whose forward sends inputs of at least `min_rows` rows to oneDNN on CPU: ONEDNN_MIN_ROWS,
    or fewer once `set_packing(True)` has given oneDNN the weight prepacked.

    Anything else (few rows, another device or dtype, autograd recording) takes `F.linear`, so the
    module stays a drop-in `nn.Linear`."""

    # set per module by set_packing (the class is switched in place: no __init__ runs)
    packs = False
    min_rows = ONEDNN_MIN_ROWS
    mkl_small = False  # a small float32 weight stays with F.linear up to MKL_MAX_ROWS (use_onednn_linears)
    _pack: torch.Tensor | None = None
    _pack_of: tuple[int, int] | None = None  # (data pointer, version) of the weight `_pack` was made from

    def set_packing(self, on: bool) -> None:
        """Prepacked weight (from one row where the weight is large) or the plain one (from ONEDNN_MIN_ROWS,
        from one row where the weight has at least PLAIN_FEW_ROWS_BYTES)."""
        self.packs = on
        size = self.weight.numel() * self.weight.element_size()
        if on:
            _PACKING.add(self)
            few = size >= PACK_FEW_ROWS_BYTES or self.weight.dtype == torch.bfloat16
            self.min_rows = 1 if few else PACKED_MIN_ROWS
        else:
            self.min_rows = 1 if size >= PLAIN_FEW_ROWS_BYTES else ONEDNN_MIN_ROWS
        if self.mkl_small and self.weight.dtype == torch.float32 and size < MKL_MAX_BYTES:
            self.min_rows = MKL_MAX_ROWS + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (
            rows < self.min_rows
            or x.device.type != "cpu"
            or x.dtype != self.weight.dtype
            or (x.dtype != torch.float32 and not self.packs)
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        ):
            return F.linear(x, self.weight, self.bias)
        flat = (x if x.dim() == 2 else x.reshape(rows, x.shape[-1])).contiguous()
        padded = bucket_rows(rows)
        if padded != rows:  # rows are independent: the extra ones only make the shape one seen before
            flat = torch.cat((flat, flat.new_zeros(padded - rows, flat.shape[1])))
        weight = self.packed_weight() if self.packs else self.weight
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, weight, self.bias, "none", [], "")
        if padded != rows:
            out = out[:rows]
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])

    def packed_weight(self) -> torch.Tensor:
        """The weight in oneDNN's layout, made again whenever the parameter's storage or values changed."""
        weight = self.weight
        key = (weight.data_ptr(), -1 if weight.is_inference() else weight._version)
        if self._pack is None or self._pack_of != key:
            with torch.no_grad():
                self._pack = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
            self._pack_of = key  # after the pack: a reader that sees the key sees its pack
        return self._pack


# The modules that pack, and which of them owns a weight at a data pointer: a compiled decode program passes
# the weight tensor, not the module, to `packed_linear`.
_PACKING: weakref.WeakSet[OneDnnLinear] = weakref.WeakSet()
_OWNERS: dict[int, weakref.ref[OneDnnLinear]] = {}


def packed_module(weight: torch.Tensor) -> OneDnnLinear | None:
    """The packing module whose weight is `weight` (found by data pointer, the table rebuilt on a miss: a
    model process swaps its parameters for shared ones after load), or None."""
    pointer = weight.data_ptr()

    def owner() -> OneDnnLinear | None:
        found = _OWNERS.get(pointer)
        module = found() if found is not None else None
        return module if module is not None and module.weight.data_ptr() == pointer else None

    if (module := owner()) is None:
        _OWNERS.clear()
        _OWNERS.update({m.weight.data_ptr(): weakref.ref(m) for m in list(_PACKING)})
        module = owner()
    return module


@torch.library.custom_op("hybridserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight^T (+ bias) through oneDNN on the weight's prepacked copy (`OneDnnLinear.
    packed_weight`, found by `packed_module`; the plain weight where no module packs it): what the eager
    forward's projections run, for the compiled decode programs (gpu_worker.model.backends.cpu.decode_program),
    where it is an extern call (about 11 us of dispatch a call)."""
    module = packed_module(weight)
    packed = module.packed_weight() if module is not None else weight
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return out


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def pack_limit(host_bytes: int) -> int:
    """The most projection-weight bytes packed on a host of `host_bytes` (0: unknown): PACK_MAX_BYTES, and
    no more than 1/PACK_HOST_SHARE of the host's memory."""
    return min(PACK_MAX_BYTES, host_bytes // PACK_HOST_SHARE) if host_bytes > 0 else PACK_MAX_BYTES


def use_onednn_linears(model: nn.Module, max_pack_bytes: int | None = None, mkl_small: bool = False) -> int:
    """Switches every plain `nn.Linear` in `model` to `OneDnnLinear` (in place: the class changes, the
    parameters and the state dict do not), packing their weights where they total at most `max_pack_bytes`
    (PACK_MAX_BYTES by default); with `mkl_small`, float32 weights under MKL_MAX_BYTES stay with F.linear
    up to MKL_MAX_ROWS rows (`small_projections`). Returns how many were switched; 0 when oneDNN is missing."""
    if not onednn_available():
        return 0
    limit = PACK_MAX_BYTES if max_pack_bytes is None else max_pack_bytes
    switched = [module for module in model.modules() if type(module) is nn.Linear]
    packs = (
        pack_available()
        and sum(m.weight.numel() * m.weight.element_size() for m in switched) <= limit
        and all(packs_dtype(m.weight.dtype) for m in switched)
    )
    for module in switched:
        module.__class__ = OneDnnLinear
        typing.cast(OneDnnLinear, module).mkl_small = mkl_small
        typing.cast(OneDnnLinear, module).set_packing(packs)
    return len(switched)


def small_projections(setting: str) -> str:
    """RunnerConfig.cpu_small_projections resolved: "mkl" or "onednn" as given; auto: "mkl" where MKL's
    sgemm takes its AVX-512 path (`mkl_takes_avx512`), else "onednn"."""
    if setting == "auto":
        return "mkl" if mkl_takes_avx512() else "onednn"
    return setting


def pack_available() -> bool:
    """Whether this torch build can reorder a dense weight into oneDNN's layout."""
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def warm_onednn_linears(
    model: nn.Module,
    max_rows: int,
    stop: threading.Event | None = None,
    row_caps: Mapping[nn.Module, int] | None = None,
) -> int:
    """Packs every projection's weight (where packing is on) and builds oneDNN's kernel for every row
    bucket from the fewest rows oneDNN takes up to `max_rows`, once per distinct projection shape of
    `model` (the kernels are cached by shape, not by weights), so that no serving step pays for a first
    call; ends early once `stop` is set. `row_caps` bounds the rows of given modules below `max_rows`:
    the LM head sees one row per sampled sequence, not a step's tokens, and at a real vocabulary its
    buckets up to 1,024 rows cost minutes of GEMMs for kernels no step calls. Returns the number of
    kernel-building calls made."""
    caps = row_caps or {}
    shapes: dict[tuple[int, int, bool, bool, int], tuple[OneDnnLinear, int]] = {}
    for module in model.modules():
        if isinstance(module, OneDnnLinear):
            if module.packs:
                module.packed_weight()
            key = (module.in_features, module.out_features, module.bias is not None, module.packs, module.min_rows)
            limit = min(max_rows, caps.get(module, max_rows))
            shapes[key] = (module, max(limit, shapes[key][1] if key in shapes else 0))
    calls = 0
    with torch.inference_mode():
        for layer, limit in shapes.values():
            for rows in sorted({bucket_rows(rows) for rows in range(layer.min_rows, limit + 1)}):
                if stop is not None and stop.is_set():
                    return calls
                layer(torch.zeros(rows, layer.in_features, dtype=layer.weight.dtype, device=layer.weight.device))
                calls += 1
    return calls
