"""The Redis key schema, in one place (version 2).

{prefix}:v2:blk:{fingerprint}:{block_hash_hex}   HASH, one per cached block:
    data        the sealed checkpoint (gpu_worker/runner/checkpoint_io.py: MAC + safetensors bytes of
                the block's attention KV and the Mamba state at its end boundary)
    sha256      hex digest of data
    fingerprint the model fingerprint (must equal the key's)
    parent      parent block hash, hex ("" for the first block)
    block_size  tokens per block
    version     the schema version that wrote it (SCHEMA_VERSION)
{prefix}:sizes:{fingerprint}   HASH, block_hash_hex -> checkpoint bytes of that block
{prefix}:bytes:{fingerprint}   STRING, their sum: the bound on bytes kept per model (it can run
                               high as Redis evicts; the store recounts before refusing)
every key carries a TTL; Redis evicts by LRU among keys with a TTL (volatile-lru) within
the memory budget. Keys and entries of another schema version are misses (never read, never
deleted: they expire).

Who touches what. The cache service owns the schema, the policy (memory budget, TTL, bytes per
model) and the lookups, and writes every block (Publish, which enforces the bounds). Workers read
block hashes directly (the fast data path: pipelined HSTRLEN + HMGET for a run of blocks, no copy
through the service) as the Redis ACL user the service sets up, limited to keys matching
`block_key_pattern` and the read commands in WORKER_COMMANDS.
"""

from __future__ import annotations

SCHEMA_VERSION = 2
FIELD_DATA = b"data"
FIELD_SHA256 = b"sha256"
FIELD_FINGERPRINT = b"fingerprint"
FIELD_PARENT = b"parent"
FIELD_BLOCK_SIZE = b"block_size"
FIELD_VERSION = b"version"
WORKER_COMMANDS = ("hmget", "hstrlen", "exists", "ping")  # reads only: no writes, CONFIG, KEYS, FLUSH*, DEL


def block_key_prefix(prefix: str, fingerprint: str) -> str:
    """Every block key of one model starts with this."""
    return f"{prefix}:v{SCHEMA_VERSION}:blk:{fingerprint}:"


def block_key(prefix: str, fingerprint: str, block_hash: bytes) -> str:
    return block_key_prefix(prefix, fingerprint) + block_hash.hex()


def block_key_pattern(prefix: str) -> str:
    """The glob of every block key of this schema version (the workers' ACL key pattern)."""
    return f"{prefix}:v{SCHEMA_VERSION}:blk:*"


def worker_acl_rules(prefix: str, password: str) -> list[str]:
    """ACL SETUSER rules of the workers' user: on, one more password, the block keys, read commands."""
    return ["on", f">{password}", "resetkeys", f"~{block_key_pattern(prefix)}", "resetchannels", "-@all",
            *(f"+{c}" for c in WORKER_COMMANDS)]  # fmt: skip


def sizes_key(prefix: str, fingerprint: str) -> str:
    return f"{prefix}:sizes:{fingerprint}"


def total_key(prefix: str, fingerprint: str) -> str:
    return f"{prefix}:bytes:{fingerprint}"
