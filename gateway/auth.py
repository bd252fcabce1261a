"""API keys: `--api-key-file` (one key per line; blank lines and `#` comments skipped) or
HYBRIDSERVE_API_KEYS (comma separated). With keys set, every API call needs `Authorization: Bearer
KEY`; health, readiness and metrics stay open."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path


def parse_keys(lines: Iterable[str]) -> frozenset[str]:
    return frozenset(k for line in lines if (k := line.split("#", 1)[0].strip()))


def load_keys(key_file: Path | None, env_value: str | None) -> frozenset[str]:
    """The accepted keys (empty: no key needed). The file wins over the variable."""
    if key_file is not None:
        return parse_keys(key_file.read_text().splitlines())
    return parse_keys((env_value or "").split(","))


def bearer_token(header: str | None) -> str | None:
    """The KEY of `Bearer KEY` (scheme case-insensitive), else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def is_authorized(keys: frozenset[str], header: str | None) -> bool:
    """True when no keys are configured, or the header carries one of them (compared in constant time)."""
    if not keys:
        return True
    token = bearer_token(header)
    if token is None:
        return False
    return any(hmac.compare_digest(token.encode(), key.encode()) for key in keys)
