"""The shared prefix-cache tier: block metadata and state checkpoints in Redis, behind the
BlockCache gRPC service. Only this package talks to Redis; its key schema lives in keys.py."""
