"""Fixtures shared by every test layer."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OTEL_SDK_DISABLED", "true")
# Workers the tests start neither compile their decode step or whole decode steps nor build kernels ahead:
# readiness waits for all three (gpu_worker.runner.warmup), which would make every worker start seconds
# slower on the 2-core CI machine. tests/model/test_compiled_decode.py covers the compiled decode step,
# tests/model/test_compiled_step.py the whole-step programs, tests/worker/test_warmup.py a worker that warms
# up with every part, tests/model/test_cpu_linear.py the kernel warm-up.
os.environ.setdefault("HYBRIDSERVE_WORKER_DECODE_COMPILE", "off")
os.environ.setdefault("HYBRIDSERVE_WORKER_COMPILE_STEP_SIZES", "off")
os.environ.setdefault("HYBRIDSERVE_WORKER_CPU_WARM_ROWS", "0")


def _interpret_triton_without_cuda() -> None:
    """Triton kernels run on CPU tensors under its interpreter when there is no GPU. The switch is read
    when `triton.jit` decorates a function (Triton's own library included), so it must be set before
    anything imports Triton (transformers may)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_cuda()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not has_cuda:  # not keywords: a folder may be named gpu
            item.add_marker(skip_gpu)
