"""Tensors in memory that two processes map: the worker and its model processes share the KV page pool,
the Mamba state pool and the weights this way (gpu_worker.runner.model_process).

Each tensor is an anonymous memory file (`memfd_create`), mapped shared. Unlike POSIX shared memory
(`/dev/shm`, which container runtimes cap at 64 MiB by default) a memory file is bounded only by the
process's memory limit, so a pool of gigabytes needs no `shm_size` setting. The file descriptor is
what travels to the other process (`multiprocessing.reduction.send_handle`); the mapping is the same
pages, so a write on one side is seen by the other without a copy.

Linux only (`os.memfd_create`); `supported()` says whether this platform has it."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

# (shape, dtype) -> a zero tensor: how a pool gets its storage (torch.zeros by default)
Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
# what an arena handed out, in order: each tensor's (shape, dtype)
Shapes = list[tuple[tuple[int, ...], torch.dtype]]


def supported() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def _map(fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
    return flat.view(shape)


class SharedArena:
    """Hands out zero tensors backed by memory files and keeps their descriptors, in allocation order.

    The owner (the worker) allocates with `zeros`; the model process builds the same pools over
    `attach`ed descriptors in the same order (see `AttachedArena`)."""

    def __init__(self, name: str = "hybridserve") -> None:
        self.name = name
        self.fds: list[int] = []
        self.shapes: Shapes = []

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        fd = os.memfd_create(f"{self.name}-{len(self.fds)}", os.MFD_CLOEXEC)
        os.ftruncate(fd, max(1, _nbytes(shape, dtype)))  # a fresh memory file reads as zeros
        self.fds.append(fd)
        self.shapes.append((tuple(shape), dtype))
        return _map(fd, tuple(shape), dtype)

    def close(self) -> None:
        """Drops the descriptors (the mappings stay valid while tensors reference them)."""
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


class AttachedArena:
    """The other side: hands out the owner's tensors, in the owner's allocation order, checking that each
    request asks for the shape and dtype the owner allocated."""

    def __init__(self, fds: list[int], shapes: Shapes) -> None:
        if len(fds) != len(shapes):
            raise ValueError(f"{len(fds)} descriptors for {len(shapes)} tensors")
        self._fds, self._shapes, self._next = fds, shapes, 0

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self._next >= len(self._fds):
            raise ValueError(f"the owner shared {len(self._fds)} tensors; asked for one more {tuple(shape)}")
        want = (tuple(shape), dtype)
        if self._shapes[self._next] != want:
            raise ValueError(f"tensor {self._next}: the owner allocated {self._shapes[self._next]}, asked {want}")
        fd = self._fds[self._next]
        self._next += 1
        return _map(fd, tuple(shape), dtype)

    @property
    def complete(self) -> bool:
        return self._next == len(self._fds)


def share_weights(model: torch.nn.Module, arena: SharedArena | AttachedArena) -> list[str]:
    """Moves every parameter of `model` into `arena`'s memory (the owner copies its values in; a model
    process, given an AttachedArena, takes the owner's memory in place of its own copy). Returns the
    parameters' names, in the order the arena handed them out (named_parameters: each tied tensor once)."""
    names = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            shared = arena.zeros(tuple(param.shape), param.dtype)
            if isinstance(arena, SharedArena):
                shared.copy_(param)
            param.data = shared
            names.append(name)
    return names
