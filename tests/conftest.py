"""Fixtures shared by every test layer."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OTEL_SDK_DISABLED", "true")
# Workers the tests start decode eagerly: a background compile in every worker process would load the
# 2-core CI machine; tests/model/test_compiled_decode.py covers the compiled decode step.
os.environ.setdefault("HYBRIDSERVE_WORKER_DECODE_COMPILE", "off")


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
