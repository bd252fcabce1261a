"""The architecture registry: config.json's `architectures` -> the adapter that serves that family."""

from __future__ import annotations

from typing import Any

from gpu_worker.model.families import bamba, granitemoehybrid, nemotron_h
from gpu_worker.model.families.base import Family
from hybridserve.errors import InvalidArgumentError

FAMILIES: tuple[Family, ...] = (bamba.FAMILY, granitemoehybrid.FAMILY, nemotron_h.FAMILY)
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
BY_NAME = {f.name: f for f in FAMILIES}
SUPPORTED_ARCHITECTURES = tuple(BY_ARCHITECTURE)


def family_for(raw: dict[str, Any], source: str) -> Family:
    """The family of a parsed config.json, by `architectures` (or `model_type` when that list is absent)."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    for arch in archs:
        if arch in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[arch]
    if not archs:
        for family in FAMILIES:
            if raw.get("model_type") == family.model_type:
                return family
    raise InvalidArgumentError(
        f"{source}: unsupported architecture (architectures={archs}, model_type={raw.get('model_type')!r}); "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def family_named(name: str) -> Family:
    """The family for an `--arch` name."""
    if name not in BY_NAME:
        raise InvalidArgumentError(f"unknown architecture {name!r}; supported: {', '.join(BY_NAME)}")
    return BY_NAME[name]
