"""The Redis memory policy the cache service owns: `maxmemory` and `volatile-lru` (LRU eviction
among keys with a TTL, which every block key has). Redis keeps neither across a restart (nothing is
persisted), so the store checks them on every new connection and puts them back."""

from __future__ import annotations

import logging

import redis

log = logging.getLogger("hybridserve.cache.store")

POLICY = "volatile-lru"


def ensure(connection: redis.connection.AbstractConnection, max_memory_bytes: int) -> tuple[str, str] | None:
    """Sets maxmemory and the eviction policy on this connection's server when they differ;
    returns the values it replaced, or None when they were right. A Redis that refuses CONFIG (a
    managed one may) is logged and left as it is: its operator owns the policy then."""
    try:
        current = (_config_get(connection, "maxmemory"), _config_get(connection, "maxmemory-policy"))
        wanted = (str(max_memory_bytes), POLICY)
        if current == wanted:
            return None
        for name, value in zip(("maxmemory", "maxmemory-policy"), wanted, strict=True):
            connection.send_command("CONFIG", "SET", name, value)  # type: ignore[no-untyped-call]
            connection.read_response()
    except redis.exceptions.ResponseError as exc:
        log.warning("cannot set the Redis memory policy (%s); leaving Redis's own", exc)
        return None
    return current


def _config_get(connection: redis.connection.AbstractConnection, name: str) -> str:
    connection.send_command("CONFIG", "GET", name)  # type: ignore[no-untyped-call]
    reply = connection.read_response()
    # RESP2: [name, value]; RESP3: {name: value}
    value = reply.get(name.encode(), reply.get(name)) if isinstance(reply, dict) else reply[1]
    return value.decode() if isinstance(value, bytes) else str(value)
