"""The Redis key schema, in one place.

{prefix}:blk:{fingerprint}:{block_hash_hex}   HASH, one per cached block:
    data        the checkpoint (safetensors bytes: KV of the block's attention layers and the
                Mamba state at the block's end boundary)
    sha256      hex digest of data
    fingerprint the model fingerprint (must equal the key's)
    parent      parent block hash, hex ("" for the first block)
    block_size  tokens per block
{prefix}:sizes:{fingerprint}   HASH, block_hash_hex -> checkpoint bytes of that block
{prefix}:bytes:{fingerprint}   STRING, their sum: the bound on bytes kept per model (it can run
                               high as Redis evicts; the store recounts before refusing)
every key carries a TTL; Redis evicts by LRU among keys with a TTL (volatile-lru) within
the memory budget.
"""

from __future__ import annotations

FIELD_DATA = b"data"
FIELD_SHA256 = b"sha256"
FIELD_FINGERPRINT = b"fingerprint"
FIELD_PARENT = b"parent"
FIELD_BLOCK_SIZE = b"block_size"


def block_key(prefix: str, fingerprint: str, block_hash: bytes) -> str:
    return f"{prefix}:blk:{fingerprint}:{block_hash.hex()}"


def sizes_key(prefix: str, fingerprint: str) -> str:
    return f"{prefix}:sizes:{fingerprint}"


def total_key(prefix: str, fingerprint: str) -> str:
    return f"{prefix}:bytes:{fingerprint}"
