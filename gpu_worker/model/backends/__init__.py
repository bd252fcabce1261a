"""Where the model's primitive ops run, chosen once at load (`attach_kernels`):

    reference.py  every CUDA kernel's contract in plain torch loops (the oracle of the kernel tests)
    cpu/          the torch backend's fast paths on CPU (oneDNN, packed prefill, compiled decode)
    cuda/         the Triton kernels and the ops object the layers call when it is attached

The layers (model/attention.py, model/mamba2.py) run the torch code unless CUDA ops are attached.
Importing this package does not import Triton."""

from __future__ import annotations

from torch import nn

from hybridserve.errors import InvalidArgumentError

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def attach_kernels(model: nn.Module, backend: str = "auto") -> str:
    """Choose every layer's primitive ops once, at load time: 'torch' (the reference code, what CPU runs),
    'triton' (the CUDA kernels), or 'auto' (triton on CUDA when Triton imports, else torch). Returns the
    name chosen. Nothing outside the model needs to know which one runs."""
    from gpu_worker.model.attention import PagedAttention
    from gpu_worker.model.mamba2 import Mamba2Mixer

    if backend not in BACKENDS:
        raise InvalidArgumentError(f"kernel backend {backend!r} is not one of {', '.join(BACKENDS)}")
    device = next(model.parameters()).device
    name = backend
    if backend == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    ops = None
    if name == "triton":
        from gpu_worker.model.backends.cuda.ops import TritonOps

        ops = TritonOps()
    for module in model.modules():
        if isinstance(module, PagedAttention | Mamba2Mixer):
            module.ops = ops
    return name


def kernel_backend(model: nn.Module) -> str:
    """The backend `attach_kernels` chose ('torch' when none was attached)."""
    for module in model.modules():
        ops = getattr(module, "ops", None)
        if ops is not None:
            return str(ops.name)
    return "torch"
