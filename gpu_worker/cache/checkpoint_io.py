"""A block's checkpoint as bytes: the KV of its attention layers (its own positions only) and the
Mamba state at its end boundary, in safetensors format, for the shared tier."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from gpu_worker.runner import ModelRunner
from hybridserve.errors import InvalidArgumentError


class ForeignCheckpointError(InvalidArgumentError):
    """A well-formed checkpoint of another model fingerprint, block size or format version."""


@dataclass(frozen=True, slots=True)
class BlockCheckpoint:
    """CPU tensors of one block."""

    kv: torch.Tensor  # [attention layers, 2 (k|v), block_size, kv heads, head dim]
    conv: torch.Tensor | None  # [mamba layers, conv_dim, d_conv - 1]; None for a KV-only block
    ssm: torch.Tensor | None  # [mamba layers, heads, head dim, d_state] float32

    @property
    def has_state(self) -> bool:
        return self.conv is not None and self.ssm is not None


def _page_slots(page_ids: list[int], page_size: int) -> torch.Tensor:
    pages = torch.tensor(page_ids, dtype=torch.int64)
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def export_block(runner: ModelRunner, page_ids: list[int], checkpoint_id: int | None) -> BlockCheckpoint:
    """Copies a cached block out of the pools (on the engine thread, before anything reuses them)."""
    slots = _page_slots(page_ids, runner.kv_page_size_tokens).to(runner.device)
    caches = runner.kv_pool.layer_caches()
    kv = torch.stack([torch.stack([k[slots], v[slots]]) for k, v in caches]).to("cpu") if caches else torch.zeros(0)
    if checkpoint_id is None:
        return BlockCheckpoint(kv=kv, conv=None, ssm=None)
    conv, ssm = runner.state_pool.export_checkpoint(checkpoint_id)
    return BlockCheckpoint(kv=kv, conv=conv, ssm=ssm)


def import_block(runner: ModelRunner, block: BlockCheckpoint, page_ids: list[int], checkpoint_id: int | None) -> None:
    """Writes a fetched block into freshly allocated pages and a checkpoint slot."""
    slots = _page_slots(page_ids, runner.kv_page_size_tokens).to(runner.device)
    caches = runner.kv_pool.layer_caches()
    expected = (len(caches), 2, len(slots), *caches[0][0].shape[1:]) if caches else (0,)
    if tuple(block.kv.shape) != tuple(expected):
        raise InvalidArgumentError(f"checkpoint KV shape {list(block.kv.shape)} does not match {list(expected)}")
    for layer, (k, v) in enumerate(caches):
        k[slots] = block.kv[layer, 0].to(k.device, k.dtype)
        v[slots] = block.kv[layer, 1].to(v.device, v.dtype)
    if checkpoint_id is not None and block.conv is not None and block.ssm is not None:
        runner.state_pool.import_checkpoint(checkpoint_id, block.conv, block.ssm)


def to_bytes(block: BlockCheckpoint, fingerprint: str, block_size: int) -> tuple[bytes, bytes]:
    """(safetensors bytes, their SHA-256)."""
    tensors = {"kv": block.kv.contiguous()}
    if block.conv is not None and block.ssm is not None:
        tensors |= {"conv": block.conv.contiguous(), "ssm": block.ssm.contiguous()}
    data = st_save(tensors, metadata={"fingerprint": fingerprint, "block_size": str(block_size)})
    return data, hashlib.sha256(data).digest()


def from_bytes(data: bytes, checksum: bytes, fingerprint: str, block_size: int) -> BlockCheckpoint:
    """Parses and verifies a checkpoint; InvalidArgumentError when it is damaged, half a state, or
    from another model or grid. A KV-only block parses (has_state False): only a hit that ends on
    it is refused."""
    if hashlib.sha256(data).digest() != checksum:
        raise InvalidArgumentError("checkpoint checksum mismatch")
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error types on malformed bytes
        raise InvalidArgumentError(f"checkpoint is not valid safetensors: {exc}") from None
    if "kv" not in tensors or ("conv" in tensors) != ("ssm" in tensors):
        raise InvalidArgumentError(f"checkpoint holds {sorted(tensors)}; expected kv, and conv with ssm")
    header_len = struct.unpack("<Q", data[:8])[0]
    meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
    if meta.get("fingerprint") != fingerprint or meta.get("block_size") != str(block_size):
        raise ForeignCheckpointError("checkpoint belongs to another model fingerprint or block size")
    return BlockCheckpoint(kv=tensors["kv"], conv=tensors.get("conv"), ssm=tensors.get("ssm"))
