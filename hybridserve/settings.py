"""Command-line flags and environment variables derived from settings dataclasses.

Every setting is a field of one frozen dataclass (its default lives there, once). A server adds the
fields it exposes to its parser with `add_settings_arguments` and builds the dataclass back with
`settings_from_args`; each flag also reads one environment variable, named

    HYBRIDSERVE_<SERVICE>_<FIELD>     e.g. HYBRIDSERVE_WORKER_BLOCK_SIZE, HYBRIDSERVE_CACHE_REDIS_URL

so that several services can share one environment (under `hybridserve up`, or one compose env file)
without one's variable setting another's flag. The flag is `--field-name` unless a `Flag` names it
otherwise (older flag names stay as they are); `--help` shows each flag's variable. A variable holds
the field's value in the field's unit (HYBRIDSERVE_WORKER_MEMORY_BUDGET_BYTES is in bytes, while its
flag --memory-budget-mb is in MiB). The environment is read here, once, while the parser is built;
a flag on the command line wins over its variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "HYBRIDSERVE_"
API_KEYS_ENV = "HYBRIDSERVE_API_KEYS"  # accepted API keys, comma separated (one name for every server)
API_KEY_ENV = "HYBRIDSERVE_API_KEY"  # the key clients (`generate`, `bench`) send
CLUSTER_TOKEN_ENV = "HYBRIDSERVE_CLUSTER_TOKEN"  # BlockCache: accepted tokens (comma separated); clients send the first
CHECKPOINT_KEY_ENV = "HYBRIDSERVE_WORKER_CHECKPOINT_KEY"  # workers' MAC key for shared-tier checkpoints
REDIS_PASSWORD_ENV = "HYBRIDSERVE_CACHE_REDIS_PASSWORD"  # the cache service's Redis AUTH password
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})

T = TypeVar("T")
Parser = argparse.ArgumentParser | argparse._ArgumentGroup


@dataclass(frozen=True, slots=True)
class Flag:
    """How one field appears on the command line, where the derived form does not fit."""

    help: str = ""  # one line for --help
    name: str = ""  # the flag, e.g. "--redis"; "" = "--" + the field name with dashes
    scale: int = 1  # field value = flag value * scale (e.g. 1 << 20 for a flag in MiB, a field in bytes)
    metavar: str | None = None
    switch: bool = False  # a bool flag that only turns the field on (`--no-cache`), not --x/--no-x


def env_name(service: str, field_name: str) -> str:
    """HYBRIDSERVE_<SERVICE>_<FIELD>: the one variable that sets this service's field."""
    return f"{ENV_PREFIX}{service.upper()}_{field_name.upper()}"


def secret_from_env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """A secret handed over in the environment (never a flag: argv shows in `ps`); None when unset
    or empty. Secrets have their own documented names (API_KEYS_ENV) instead of a derived flag."""
    value = (os.environ if environ is None else environ).get(name, "")
    return value or None


def parse_bool(raw: str) -> bool:
    """true/false, yes/no, on/off, 1/0 (any case)."""
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError("expected true or false")


def _unwrap_optional(kind: Any) -> tuple[Any, bool]:
    """(X, True) for `X | None`, (kind, False) otherwise."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return kind, False


def _parser_for(kind: Any) -> Callable[[str], Any]:
    """Turns one string (a flag's argument or a variable's value) into a field value of `kind`."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        members = {m.name.lower(): m for m in kind}

        def parse_enum(raw: str) -> Any:
            try:
                return members[raw.strip().lower()]
            except KeyError:
                raise ValueError(f"expected one of {', '.join(members)}") from None

        return parse_enum
    if typing.get_origin(kind) is tuple:
        return lambda raw: tuple(part.strip() for part in raw.split(",") if part.strip())
    if kind is bool:
        return parse_bool
    if kind in (int, float, str, Path):
        return typing.cast(Callable[[str], Any], kind)
    raise TypeError(f"no command-line form for fields of type {kind!r}")


def _scaled(parse: Callable[[str], Any], scale: int) -> Callable[[str], Any]:
    """A flag given in a larger unit (MiB) for a field in a smaller one (bytes)."""
    return lambda raw: parse(raw) * scale


def _field_default(field: dataclasses.Field[Any], defaults: Mapping[str, Any]) -> Any:
    if field.name in defaults:
        return defaults[field.name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise TypeError(f"field {field.name} has no default; pass one in `defaults`")


def _env_value(name: str, raw: str, parse: Callable[[str], Any]) -> Any:
    try:
        return parse(raw)
    except ValueError as exc:
        raise SystemExit(f"environment variable {name}={raw!r} is not valid: {exc}") from None


def add_settings_arguments(
    parser: Parser,
    cls: type[Any],
    service: str,
    *,
    flags: Mapping[str, Flag] | None = None,
    defaults: Mapping[str, Any] | None = None,
    exclude: Iterable[str] = (),
    only: Iterable[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Adds one flag per field of dataclass `cls` (except `exclude`; only `only` when given), defaulting to the field's
    default, or to the value of its HYBRIDSERVE_<SERVICE>_<FIELD> variable when that is set.

    `defaults` supplies a default for fields the dataclass leaves required. The flag stores the
    field's value under the field's name (so `settings_from_args` finds it)."""
    env = os.environ if environ is None else environ
    flags, defaults, skip = flags or {}, defaults or {}, set(exclude)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip or (only is not None and field.name not in only):
            continue
        flag = flags.get(field.name, Flag())
        kind, optional = _unwrap_optional(hints[field.name])
        parse_field = _parser_for(kind)  # the variable holds the field's value, in the field's unit
        parse = parse_field if flag.scale == 1 else _scaled(parse_field, flag.scale)
        variable = env_name(service, field.name)
        default = _field_default(field, defaults)
        if variable in env and env[variable] != "":
            default = _env_value(variable, env[variable], parse_field)
        shown = default // flag.scale if flag.scale != 1 and default is not None else default
        if isinstance(shown, enum.Enum):
            shown = shown.name.lower()
        elif isinstance(shown, tuple):
            shown = ",".join(shown)
        text = f"{flag.help} (env {variable}; default {shown})" if flag.help else f"env {variable}; default {shown}"
        option = flag.name or "--" + field.name.replace("_", "-")
        if kind is bool and not optional:
            action = "store_true" if flag.switch else argparse.BooleanOptionalAction
            parser.add_argument(option, dest=field.name, action=action, default=default, help=text)
            continue
        choices = [m.name.lower() for m in kind] if isinstance(kind, type) and issubclass(kind, enum.Enum) else None
        metavar = "{" + ",".join(choices) + "}" if choices else option.lstrip("-").replace("-", "_").upper()
        parser.add_argument(
            option, dest=field.name, type=parse, default=default, help=text, metavar=flag.metavar or metavar
        )


def settings_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """The dataclass built from the parsed flags named after its fields, plus `overrides` (for
    fields derived from other settings). Validation is the dataclass's own (__post_init__)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}  # type: ignore[arg-type]
    values.update(overrides)
    return cls(**values)
