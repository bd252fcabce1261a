"""A block's checkpoint as bytes for the shared tier: the KV of its attention layers (its own
positions only) and the Mamba state at its end boundary, sealed so that storage cannot forge it.

The shared tier (the cache service, Redis, any transport between) is untrusted storage: whoever can
write there could otherwise serve one prefix's state under another prefix's hash, or a tensor of the
wrong shape. So a checkpoint names its block and carries a MAC that only workers can make:

    MAGIC (8 bytes) | salt (16 random bytes) | tag (16 bytes) | body

    tag = GMAC(subkey, body): AES-256-GCM over no plaintext with the body as associated data
    subkey = HMAC-SHA256(key, FORMAT_VERSION | salt)

Each seal draws a fresh salt, so every subkey tags exactly one body and GMAC's one-time-key bound
holds (no nonce to track, no limit on checkpoints per key); the salt itself is covered because it
picks the subkey. GMAC runs at tens of GB/s where the CPU has carry-less multiply (PCLMULQDQ),
against about 2 GB/s for HMAC-SHA256 over the whole body: verifying a fetched block costs a small
part of reading it from Redis.

body is safetensors: tensors `kv` (and `conv` with `ssm` at a state boundary) plus metadata naming the
block (format version, block hash, parent hash, block size, model fingerprint). The safetensors header
also fixes every tensor's name, dtype, shape and offsets, so the MAC covers all of it and the bytes.

`verify` checks, in order and before a single tensor is built: the envelope, the MAC (constant time),
the block's identity against the one the worker asked for, and the tensor names, dtypes and shapes
against what this worker's pools take (`CheckpointLayout`). A failure is a `Rejection` with a reason,
never an exception: the caller counts it as a miss and deletes the entry. `seal` and `verify` are pure
(bytes in, bytes or verdict out), so any transport can use them.
"""

from __future__ import annotations

import hmac
import json
import os
import struct
import warnings
from dataclasses import dataclass
from hashlib import sha256

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from safetensors.torch import save as st_save

from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.state_pool import MambaStatePool
from hybridserve.errors import InvalidArgumentError

FORMAT_VERSION = "hybridserve-checkpoint/3"
MAGIC = b"HSCKPT03"
SALT_BYTES = 16
TAG_BYTES = 16
HEAD_BYTES = len(MAGIC) + SALT_BYTES + TAG_BYTES  # the envelope before the safetensors body
_NONCE = bytes(12)  # each subkey tags one body only, so a fixed nonce is safe
MIN_KEY_BYTES = 16
MAX_HEADER_BYTES = 1 << 20  # a safetensors header of a few tensors is far below this
_DTYPE_NAMES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


@dataclass(frozen=True, slots=True)
class BlockCheckpoint:
    """CPU tensors of one block."""

    kv: torch.Tensor  # [attention layers, 2 (k|v), block_size, kv heads, head dim]
    conv: torch.Tensor | None  # [mamba layers, conv_dim, d_conv - 1]; None for a KV-only block
    ssm: torch.Tensor | None  # [mamba layers, heads, head dim, d_state] float32

    @property
    def has_state(self) -> bool:
        return self.conv is not None and self.ssm is not None


@dataclass(frozen=True, slots=True)
class BlockIdentity:
    """What a checkpoint is of: the worker states it when sealing and when verifying."""

    block_hash: bytes  # the block's chained hash
    parent_hash: bytes  # the previous block's chained hash; b"" for a prompt's first block
    block_size: int  # tokens per block (the checkpoint grid)
    fingerprint: str  # the model's fingerprint

    def metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT_VERSION, "block_hash": self.block_hash.hex(), "parent_hash": self.parent_hash.hex(),
            "block_size": str(self.block_size), "fingerprint": self.fingerprint,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorSpec:
    shape: tuple[int, ...]  # exact shape the pool takes
    dtype: str  # safetensors dtype name, e.g. "F32"


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """The tensors this worker's pools take for one block: `kv` always, `conv` and `ssm` together."""

    kv: TensorSpec
    conv: TensorSpec
    ssm: TensorSpec

    @classmethod
    def of_pools(cls, kv_pool: KVPagePool, state_pool: MambaStatePool, block_size: int) -> CheckpointLayout:
        caches = kv_pool.layer_caches()
        if caches:
            k = caches[0][0]
            kv = TensorSpec((len(caches), 2, block_size, *k.shape[1:]), dtype_name(k.dtype))
        else:
            kv = TensorSpec((0,), "F32")  # export_block's empty KV of a model without attention
        (conv_shape, conv_dtype), (ssm_shape, ssm_dtype) = state_pool.checkpoint_layout()
        return cls(kv, TensorSpec(conv_shape, dtype_name(conv_dtype)), TensorSpec(ssm_shape, dtype_name(ssm_dtype)))


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a checkpoint was refused; it is a miss, and its stored copy should be deleted."""

    reason: str  # format | mac | identity | layout: a metric label
    detail: str  # for the log line; never holds the key

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def check_key(key: bytes) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise InvalidArgumentError(f"the checkpoint key must be at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return key


def tag_of(key: bytes, salt: bytes, body: bytes | memoryview) -> bytes:
    """GMAC of the body under the salt's one-time subkey (no copy of a large body)."""
    subkey = hmac.new(key, FORMAT_VERSION.encode() + salt, sha256).digest()
    return AESGCM(subkey).encrypt(_NONCE, b"", body)


def seal_body(body: bytes, key: bytes) -> bytes:
    """A safetensors body in its sealed envelope: what only a holder of the workers' key can make."""
    salt = os.urandom(SALT_BYTES)
    return MAGIC + salt + tag_of(key, salt, body) + body


def seal(block: BlockCheckpoint, identity: BlockIdentity, key: bytes) -> bytes:
    """The checkpoint's bytes for the shared tier, MAC'd with the workers' key."""
    tensors = {"kv": block.kv.contiguous()}
    if block.conv is not None and block.ssm is not None:
        tensors |= {"conv": block.conv.contiguous(), "ssm": block.ssm.contiguous()}
    return seal_body(st_save(tensors, metadata=identity.metadata()), key)


def verify(data: bytes, identity: BlockIdentity, layout: CheckpointLayout, key: bytes) -> BlockCheckpoint | Rejection:
    """The checkpoint in `data` if it is genuine, of this block and fits these pools; else why not."""
    if len(data) < HEAD_BYTES + 8 or not data.startswith(MAGIC):
        return Rejection("format", f"not a {FORMAT_VERSION} checkpoint")
    view = memoryview(data)
    body = view[HEAD_BYTES:]
    salt, tag = bytes(view[len(MAGIC) : len(MAGIC) + SALT_BYTES]), bytes(view[HEAD_BYTES - TAG_BYTES : HEAD_BYTES])
    if not hmac.compare_digest(tag, tag_of(key, salt, body)):
        return Rejection("mac", "MAC mismatch: not made by a worker holding this key, or altered")
    header = _header(body)
    if isinstance(header, Rejection):
        return header
    got = header.pop("__metadata__", {})
    if got != identity.metadata():
        wrong = sorted(k for k, v in identity.metadata().items() if got.get(k) != v) or ["extra fields"]
        return Rejection("identity", f"checkpoint is of another block ({', '.join(wrong)} differ)")
    problem = _layout_problem(header, layout)
    if problem is not None:
        return Rejection("layout", problem)
    tensors = _views(body, header)
    if isinstance(tensors, Rejection):
        return tensors
    return BlockCheckpoint(kv=tensors["kv"], conv=tensors.get("conv"), ssm=tensors.get("ssm"))


def _views(body: memoryview, header: dict[str, dict[str, object]]) -> dict[str, torch.Tensor] | Rejection:
    """Read-only tensors over the checkpoint's own bytes (no copy: `import_block` copies them into
    the pools once). The header's dtypes and shapes were checked against the layout already; here
    each tensor's byte range must lie in the data section and hold exactly its elements."""
    (length,) = struct.unpack("<Q", body[:8])
    base, data_len = 8 + length, len(body) - 8 - length
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        dtype = _DTYPES_BY_NAME.get(str(entry.get("dtype")))
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if dtype is None or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
            return Rejection("format", f"{name}: malformed safetensors entry")
        start, end = offsets
        numel = 1
        for dim in shape:
            numel *= int(dim)
        item = torch.empty(0, dtype=dtype).element_size()
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data_len):
            return Rejection("format", f"{name}: byte range {offsets} outside the data ({data_len} bytes)")
        if end - start != numel * item:
            return Rejection("format", f"{name}: {end - start} bytes for {numel} elements of {item} bytes")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the buffer is read-only; nothing writes to it
            out[name] = torch.frombuffer(body, dtype=dtype, count=numel, offset=base + start).view(shape)
    return out


def _header(body: memoryview) -> dict[str, dict[str, object]] | Rejection:
    """The safetensors JSON header (tensor name -> dtype, shape, offsets; plus __metadata__)."""
    (length,) = struct.unpack("<Q", body[:8])
    if length > min(MAX_HEADER_BYTES, len(body) - 8):
        return Rejection("format", f"safetensors header of {length} bytes does not fit")
    try:
        header = json.loads(bytes(body[8 : 8 + length]))
    except (ValueError, UnicodeDecodeError) as exc:
        return Rejection("format", f"safetensors header is not JSON: {exc}")
    if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        return Rejection("format", "safetensors header is not a table of tensors")
    return header


def _layout_problem(header: dict[str, dict[str, object]], layout: CheckpointLayout) -> str | None:
    names = set(header)
    if names not in ({"kv"}, {"kv", "conv", "ssm"}):
        return f"checkpoint holds {sorted(names)}; expected kv, and conv with ssm"
    for name in sorted(names):
        spec: TensorSpec = getattr(layout, name)
        shape, dtype = header[name].get("shape"), header[name].get("dtype")
        if not isinstance(shape, list) or tuple(shape) != spec.shape or dtype != spec.dtype:
            return f"{name} is {dtype} {shape}; this worker's pools take {spec.dtype} {list(spec.shape)}"
    return None


def _page_slots(page_ids: list[int], page_size: int) -> torch.Tensor:
    pages = torch.tensor(page_ids, dtype=torch.int64)
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def export_block(
    kv_pool: KVPagePool, state_pool: MambaStatePool, device: torch.device, page_ids: list[int],
    checkpoint_id: int | None,
) -> BlockCheckpoint:  # fmt: skip
    """Copies a cached block out of the pools (on the engine thread, before anything reuses them)."""
    slots = _page_slots(page_ids, kv_pool.page_size_tokens).to(device)
    caches = kv_pool.layer_caches()
    kv = torch.stack([torch.stack([k[slots], v[slots]]) for k, v in caches]).to("cpu") if caches else torch.zeros(0)
    if checkpoint_id is None:
        return BlockCheckpoint(kv=kv, conv=None, ssm=None)
    conv, ssm = state_pool.export_checkpoint(checkpoint_id)
    return BlockCheckpoint(kv=kv, conv=conv, ssm=ssm)


def import_block(
    kv_pool: KVPagePool, state_pool: MambaStatePool, device: torch.device, block: BlockCheckpoint,
    page_ids: list[int], checkpoint_id: int | None,
) -> None:  # fmt: skip
    """Writes a verified block into freshly allocated pages and a checkpoint slot."""
    slots = _page_slots(page_ids, kv_pool.page_size_tokens).to(device)
    caches = kv_pool.layer_caches()
    expected = (len(caches), 2, len(slots), *caches[0][0].shape[1:]) if caches else (0,)
    if tuple(block.kv.shape) != tuple(expected):
        raise InvalidArgumentError(f"checkpoint KV shape {list(block.kv.shape)} does not match {list(expected)}")
    for layer, (k, v) in enumerate(caches):
        k[slots] = block.kv[layer, 0].to(k.device, k.dtype)
        v[slots] = block.kv[layer, 1].to(v.device, v.dtype)
    if checkpoint_id is not None and block.conv is not None and block.ssm is not None:
        state_pool.import_checkpoint(checkpoint_id, block.conv, block.ssm)
