"""Block identity: a chained hash over (parent hash, the block's token ids, model fingerprint,
block_size), so equal hashes mean equal prefixes of the same model on the same grid."""

from __future__ import annotations

import hashlib
from array import array

ROOT_PARENT = b""


def block_hash(parent: bytes, token_ids: list[int] | tuple[int, ...], fingerprint: str, block_size: int) -> bytes:
    digest = hashlib.sha256()
    digest.update(len(parent).to_bytes(1, "little") + parent)
    digest.update(fingerprint.encode() + b"\x00" + block_size.to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def chain_hashes(
    token_ids: list[int], block_size: int, fingerprint: str, known: list[bytes] | None = None
) -> list[bytes]:
    """Hashes of every full block of token_ids, extending `known` (hashes of the leading blocks)."""
    hashes = list(known or [])
    parent = hashes[-1] if hashes else ROOT_PARENT
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[index * block_size : (index + 1) * block_size], fingerprint, block_size)
        hashes.append(parent)
    return hashes
