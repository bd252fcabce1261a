"""Compiles every Triton kernel for an H100/H200 (sm_90) ahead of time, without a GPU, at the serving
shapes (bf16, head dim 128, state 128) and the float32 test shapes; prints one line per kernel with its
shared memory. Exits non-zero when a kernel does not compile or needs more shared memory than an SM has.

Run by tests/model/test_triton_compile.py in a fresh process: the compiler is off under
TRITON_INTERPRET=1, which the test session sets when there is no GPU.

    python tests/model/triton_compile_check.py
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gpu_worker.model.backends.cuda import attention as attn_k
from gpu_worker.model.backends.cuda import mamba as mamba_k

SM90_SHARED_BYTES = 232448  # 227 KiB: the most one block may use on sm_90
INDEX_POINTERS = {"table_ptr": "*i32", "seq_lens_ptr": "*i64", "slots_ptr": "*i64", "spans_ptr": "*i64",
                  "slot_map_ptr": "*i64"}  # fmt: skip
FLOAT32_POINTERS = {"dt_ptr", "a_ptr", "d_ptr", "y_ptr", "state_ptr"}  # SSM update: float32 (its state)


def signature(fn: Any, constexprs: dict[str, Any], dtype: str, float32_pointers: set[str]) -> dict[str, str]:
    """Triton types of a kernel's parameters from their names: *_ptr pointers, the rest int32 (scale fp32)."""
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = INDEX_POINTERS.get(name, "*fp32" if name in float32_pointers else f"*{dtype}")
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    return sig


def cases() -> list[tuple[Any, str, dict[str, Any], set[str]]]:
    """(kernel, activation dtype, constexprs, float32 pointers)."""
    attn = attn_k
    out: list[tuple[Any, str, dict[str, Any], set[str]]] = []
    for dtype, fp32 in (("bf16", False), ("fp32", True)):
        out += [
            (attn._write_kv_kernel, dtype, {"KV_HEADS": 4, "HEAD_DIM": 128, "BLOCK_H": 4, "BLOCK_D": 128}, set()),
            (attn._paged_decode_kernel, dtype, {"GROUP": 4, "HEAD_DIM": 128, "PAGE_SIZE": 16, "BLOCK_G": 16,
             "BLOCK_D": 128, "BLOCK_N": attn.DECODE_BLOCK_N, "FP32": fp32}, set()),
            (attn._paged_prefill_kernel, dtype, {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_M": attn.PREFILL_BLOCK_M,
             "BLOCK_N": attn.PREFILL_BLOCK_N, "BLOCK_D": 128, "FP32": fp32}, set()),
            (mamba_k._conv_update_kernel, dtype, {"KW": 4, "HAS_BIAS": True, "BLOCK_C": mamba_k.CONV_BLOCK_C,
             "BLOCK_K": 4}, set()),
            (mamba_k._conv_varlen_kernel, dtype, {"KW": 4, "HAS_BIAS": True, "BLOCK_C": mamba_k.CONV_BLOCK_C,
             "BLOCK_T": mamba_k.CONV_BLOCK_T, "BLOCK_K": 4}, set()),
            (mamba_k._ssm_update_kernel, dtype, {"HEADS_PER_GROUP": 64, "HEAD_DIM": 64, "D_STATE": 128, "HAS_D": True,
             "HAS_Z": True, "BLOCK_P": mamba_k.SSM_BLOCK_P, "BLOCK_N": 128}, FLOAT32_POINTERS),
        ]  # fmt: skip
    out.append((attn._paged_decode_kernel, "fp32", {"GROUP": 2, "HEAD_DIM": 16, "PAGE_SIZE": 4, "BLOCK_G": 16,
                "BLOCK_D": 16, "BLOCK_N": attn.DECODE_BLOCK_N, "FP32": True}, set()))  # fmt: skip
    out.append((mamba_k._conv_varlen_kernel, "fp32", {"KW": 2, "HAS_BIAS": False, "BLOCK_C": mamba_k.CONV_BLOCK_C,
                "BLOCK_T": mamba_k.CONV_BLOCK_T, "BLOCK_K": 2}, set()))  # fmt: skip
    return out


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    failures = 0
    for fn, dtype, constexprs, f32 in cases():
        label = f"{fn.fn.__name__}[{dtype}, {', '.join(f'{k}={v}' for k, v in constexprs.items())}]"
        try:
            src = ASTSource(fn=fn, signature=signature(fn, constexprs, dtype, f32), constexprs=constexprs)
            shared = int(triton.compile(src, target=target).metadata.shared)
        except Exception as exc:  # report every kernel, not only the first failure
            print(f"FAIL {label}: {type(exc).__name__}: {exc}")
            failures += 1
            continue
        ok = shared <= SM90_SHARED_BYTES
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label}: shared {shared} bytes")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
