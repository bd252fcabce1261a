"""A checkpoint's `generation_config.json`: its end-of-sequence ids and the sampling defaults a request that
leaves temperature, top_p or top_k unset is served with. Pure: json in, a frozen dataclass out.

The defaults rule (as vLLM's `--generation-config auto`): a value the request sets wins; a value it leaves unset
is the checkpoint's, when generation_config.json names it; else the API's own default (the Generation API:
greedy, top_p and top_k off; the OpenAI API: temperature 1, top_p and top_k off). Only the keys the file holds
count (`do_sample` is not read: a file that names a temperature samples at it)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridserve.errors import InvalidArgumentError

GENERATION_CONFIG_FILE = "generation_config.json"
MAX_TEMPERATURE = 100.0  # as the worker accepts on the wire
# Temperatures below this sample greedily: logits divided by 1e-38 overflow float32 to inf, and the
# softmax of infs is NaN (a sampler then takes token 0 every step). Below 1e-5 the distribution is
# already one-hot for any logit gap above ~1e-3, so greedy is what such a temperature means.
GREEDY_BELOW_TEMPERATURE = 1e-5


def effective_temperature(temperature: float) -> float:
    """The temperature sampling runs at: 0 (greedy) for any value in [0, GREEDY_BELOW_TEMPERATURE), else
    the value itself (range checks are the caller's)."""
    return 0.0 if 0.0 <= temperature < GREEDY_BELOW_TEMPERATURE else temperature


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What generation_config.json says; None (or empty) where it says nothing."""

    eos_token_ids: tuple[int, ...] = ()  # `eos_token_id`, an int or a list
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None  # in (0, 1]; 1 = off
    top_k: int | None = None  # 0 = off

    def sampling(
        self, temperature: float | None, top_p: float | None, top_k: int | None, fallback: tuple[float, float, int]
    ) -> tuple[float, float, int]:
        """(temperature, top_p, top_k) for a request: each of its own values when set, else this checkpoint's,
        else `fallback`'s (the API's default)."""
        chosen = (
            _first(temperature, self.temperature, fallback[0]),
            _first(top_p, self.top_p, fallback[1]),
            _first(top_k, self.top_k, fallback[2]),
        )
        return effective_temperature(float(chosen[0])), float(chosen[1]), int(chosen[2])


def _first(*values: float | int | None) -> float | int:
    return next(v for v in values if v is not None)


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A checkpoint's JSON file as a dict; None when it does not exist. Unreadable JSON, or anything
    but an object at the top level, is an InvalidArgumentError naming the file."""
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise InvalidArgumentError(f"{path}: expected a JSON object at the top level")
    return raw


def read_generation_config(model_dir: Path | None) -> GenerationDefaults:
    """The folder's generation_config.json; empty defaults when there is no folder or no file."""
    path = None if model_dir is None else model_dir / GENERATION_CONFIG_FILE
    raw = None if path is None else read_json_object(path)
    return GenerationDefaults() if raw is None else parse_generation_config(raw, str(path))


def parse_generation_config(raw: dict[str, Any], source: str = GENERATION_CONFIG_FILE) -> GenerationDefaults:
    """The defaults of a generation_config.json dict; a value out of range names the file and the key."""

    def bad(key: str, expected: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{source}: '{key}' must be {expected}, got {raw[key]!r}; fix or remove it")

    def number(key: str, low: float, high: float) -> float | None:
        value = raw.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value)):
            raise bad(key, f"a number in [{low:g}, {high:g}]")
        if not low <= value <= high:
            raise bad(key, f"a number in [{low:g}, {high:g}]")
        return float(value)

    eos = raw.get("eos_token_id")
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0:
        eos_ids = (eos,)
    elif isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
        eos_ids = tuple(eos)
    else:
        raise bad("eos_token_id", "a token id or a list of token ids")
    top_k = raw.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise bad("top_k", "an integer >= 0 (0 = off)")
    top_p = number("top_p", 0.0, 1.0)
    return GenerationDefaults(
        eos_token_ids=eos_ids,
        temperature=number("temperature", 0.0, MAX_TEMPERATURE),
        top_p=None if top_p is None else (1.0 if top_p == 0 else top_p),  # 0 = off, as on the wire
        top_k=top_k,
    )
