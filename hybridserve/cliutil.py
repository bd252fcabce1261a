"""Helpers for the command line: every flag may also come from an environment variable
HYBRIDSERVE_<NAME>, read once here while the parser is built."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

ENV_PREFIX = "HYBRIDSERVE_"


def env_default(name: str, default: T, parse: Callable[[str], T] | None = None) -> T:
    """The value of $HYBRIDSERVE_<name> parsed with `parse`, or `default` when unset."""
    raw = os.environ.get(ENV_PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw) if parse is not None else raw  # type: ignore[return-value]
    except ValueError as exc:
        raise SystemExit(f"environment variable {ENV_PREFIX}{name}={raw!r} is not valid: {exc}") from None
