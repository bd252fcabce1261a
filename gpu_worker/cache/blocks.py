"""Block identity: a chained hash over (parent hash, the block's token ids, model fingerprint,
block_size), so equal hashes mean equal prefixes of the same model on the same grid.

A request's cache salt (GenerateRequest.cache_salt) is the chain's root: its first block's parent is
the salt's digest instead of the empty root, so every hash of a salted chain differs from the unsalted
one and from any other salt's (short of a SHA-256 collision). Both tiers key blocks by these hashes, so
a salted block can be neither found nor served for a request with another salt or none."""

from __future__ import annotations

import hashlib
from array import array

ROOT_PARENT = b""  # the unsalted chain's root
SALT_DOMAIN = b"hybridserve/cache-salt/v1\x00"


def chain_root(salt: str) -> bytes:
    """The first block's parent: the empty root unsalted, else a digest of the salt (32 bytes, so it
    can never equal the empty root, and block_hash frames the parent by its length)."""
    if not salt:
        return ROOT_PARENT
    return hashlib.sha256(SALT_DOMAIN + salt.encode("utf-8", "surrogatepass")).digest()


def block_hash(parent: bytes, token_ids: list[int] | tuple[int, ...], fingerprint: str, block_size: int) -> bytes:
    digest = hashlib.sha256()
    digest.update(len(parent).to_bytes(1, "little") + parent)
    digest.update(fingerprint.encode() + b"\x00" + block_size.to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def chain_hashes(
    token_ids: list[int], block_size: int, fingerprint: str, known: list[bytes] | None = None, salt: str = ""
) -> list[bytes]:
    """Hashes of every full block of token_ids, extending `known` (hashes of the leading blocks, of the
    same salt); `salt` roots the chain (chain_root)."""
    hashes = list(known or [])
    parent = hashes[-1] if hashes else chain_root(salt)
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[index * block_size : (index + 1) * block_size], fingerprint, block_size)
        hashes.append(parent)
    return hashes
