"""Bearer credentials on gRPC and HTTP: API keys (Generation, the gateway) and the cluster token
(BlockCache). Pure rules here; the gRPC interceptors that apply them are in hybridserve.grpc_auth.

Keys come from a file (one per line; blank lines and `#` comments skipped) or a variable (comma
separated), never from argv. One rule on every server (gateway HTTP and gRPC, worker, scheduler, cache):
a missing or invalid credential is UNAUTHENTICATED (HTTP 401); PERMISSION_DENIED (HTTP 403) is kept for a
valid credential that may not do what it asks. Refusals are logged with the method and the peer, never
the key. Health and reflection stay open (probes carry no credentials)."""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path

AUTHORIZATION = "authorization"  # the header / metadata key
UNAUTHENTICATED = "UNAUTHENTICATED"  # no credential sent, or one that is not accepted
PERMISSION_DENIED = "PERMISSION_DENIED"  # an accepted credential that may not do what it asks


def parse_keys(lines: Iterable[str]) -> frozenset[str]:
    return frozenset(k for line in lines if (k := line.split("#", 1)[0].strip()))


def load_keys(key_file: Path | None, env_value: str | None) -> frozenset[str]:
    """The accepted keys (empty: no key needed). The file wins over the variable."""
    if key_file is not None:
        return parse_keys(Path(key_file).expanduser().read_text().splitlines())
    return parse_keys((env_value or "").split(","))


def load_secret(secret_file: Path | None, env_value: str | None) -> str | None:
    """One secret (a token, a password, a key): the file's first line when given, else the variable's
    value; None when neither holds one."""
    if secret_file is not None:
        lines = Path(secret_file).expanduser().read_text().splitlines()
        value = lines[0].strip() if lines else ""
        if not value:
            raise OSError(f"{secret_file} is empty")
        return value
    return env_value or None


def bearer_token(header: str | None) -> str | None:
    """The KEY of `Bearer KEY` (scheme case-insensitive), else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def is_accepted(keys: frozenset[str], token: str) -> bool:
    """True when token is one of keys (compared in constant time)."""
    return any(hmac.compare_digest(token.encode(), key.encode()) for key in keys)


def is_authorized(keys: frozenset[str], header: str | None) -> bool:
    """True when no keys are configured, or the header carries one of them."""
    if not keys:
        return True
    token = bearer_token(header)
    return token is not None and is_accepted(keys, token)


def check_bearer(keys: frozenset[str], header: str | None) -> tuple[str, str] | None:
    """None when the call may proceed; else its status name and a message that says what to send."""
    if not keys:
        return None
    token = bearer_token(header)
    if token is None:
        return UNAUTHENTICATED, "missing credentials: send metadata authorization: Bearer KEY"
    if not is_accepted(keys, token):
        return UNAUTHENTICATED, "the credential sent is not accepted here; send one this server accepts"
    return None


def write_private(path: Path, data: bytes) -> Path:
    """Writes data to a file readable by its owner only (0600 from creation, not chmod after)."""
    path = Path(path)
    path.unlink(missing_ok=True)  # O_CREAT keeps an existing file's mode
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path
