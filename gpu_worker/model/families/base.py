"""What an architecture adapter is, and the config-reading helpers every adapter shares.

An adapter turns one Hugging Face family into our layer stack: `parse` reads `config.json` into a
`ModelConfig`; `source_of` names, for each of our parameters, the checkpoint tensors it is built from
(one tensor, several concatenated along dim 0, or per-expert tensors stacked into one)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gpu_worker.model.config import ModelConfig
from hybridserve.errors import InvalidArgumentError

Combine = Literal["one", "cat", "stack"]


@dataclass(frozen=True, slots=True)
class Source:
    """The checkpoint tensors one of our parameters is made of."""

    names: tuple[str, ...]  # checkpoint tensor names, in order
    combine: Combine = "one"  # one: the tensor itself; cat: concatenated on dim 0; stack: stacked on a new dim 0

    def shapes(self, ours: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The shape each checkpoint tensor must have for our parameter to have shape `ours`."""
        if self.combine == "one":
            return (ours,)
        if self.combine == "stack":
            return tuple(ours[1:] for _ in self.names)
        return tuple((ours[0] // len(self.names), *ours[1:]) for _ in self.names)


class SpecLike(Protocol):
    """The sizes `hybridserve init-model` asks of a family's tiny config (see `hybridserve_cli.init_model`)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def attn_layer_indices(self) -> tuple[int, ...]: ...

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def mamba_n_heads(self) -> int: ...

    @property
    def mamba_n_groups(self) -> int: ...

    @property
    def mamba_d_state(self) -> int: ...

    @property
    def mamba_d_conv(self) -> int: ...

    @property
    def mamba_expand(self) -> int: ...

    @property
    def mamba_chunk_size(self) -> int: ...

    @property
    def moe(self) -> bool: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def num_experts_per_tok(self) -> int: ...

    @property
    def mtp(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Family:
    """One supported architecture: its names, config parser and weight mapping."""

    name: str  # the `--arch` name, e.g. "granitemoehybrid"
    architecture: str  # config.json's architectures entry, e.g. "GraniteMoeHybridForCausalLM"
    model_type: str  # config.json's model_type
    parse: Callable[[dict[str, Any], str], ModelConfig]  # (raw config.json, its path for messages)
    source_of: Callable[[str, ModelConfig], Source]  # our parameter name -> the checkpoint tensors
    tiny_hf_config: Callable[[SpecLike], dict[str, Any]]  # a small config.json for init-model and tests
    ignored: tuple[str, ...] = ()  # regexes of checkpoint tensors that are not served (and why, in the module)
    renames: tuple[tuple[str, str], ...] = ()  # (regex, replacement) applied to checkpoint names first
    # checkpoint names of the multi-token-prediction head: served when the config has one, else ignored
    head_prefix: str | None = None

    def normalise(self, name: str, config: ModelConfig | None = None) -> str | None:
        """The canonical checkpoint name, or None for a tensor that is not served (the MTP head's, when
        `config` has none)."""
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        if self.head_prefix and name.startswith(self.head_prefix) and config is not None and not config.mtp_blocks:
            return None
        return None if any(re.search(p, name) for p in self.ignored) else name


class Getter:
    """Reads config.json fields (with legacy aliases) with messages that name the field and the file."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def _value(self, keys: tuple[str, ...], default: Any) -> tuple[str, Any]:
        for key in keys:
            if self.raw.get(key) is not None:
                return key, self.raw[key]
        return keys[0], default

    def integer(self, *keys: str, default: int | None = None) -> int:
        key, value = self._value(keys, default)
        if value is None:
            raise InvalidArgumentError(f"{self.source}: required field {key!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{self.source}: {key} must be an integer, got {value!r}")
        return value

    def number(self, *keys: str, default: float) -> float:
        key, value = self._value(keys, default)
        if isinstance(value, dict) and "__float__" in value:  # how transformers spells inf in JSON
            value = value["__float__"]
        try:
            return float(value)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{self.source}: {key} must be a number, got {value!r}") from exc

    def flag(self, *keys: str, default: bool) -> bool:
        return bool(self._value(keys, default)[1])

    def time_step_limit(self, *keys: str) -> tuple[float, float]:
        key, value = self._value(keys, None)
        if value is None:
            return 0.0, math.inf
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise InvalidArgumentError(f"{self.source}: {key} must be a pair [min, max], got {value!r}")
        pair = Getter({"min": value[0], "max": value[1]}, self.source)
        return pair.number("min", default=0.0), pair.number("max", default=math.inf)

    def eos_ids(self) -> tuple[int, ...]:
        eos = self.raw.get("eos_token_id")
        return tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

    def require(self, key: str, allowed: tuple[Any, ...], default: Any) -> Any:
        """A field the runner implements only for some values; others are rejected by name."""
        value = self.raw.get(key, default)
        if value not in allowed:
            raise InvalidArgumentError(
                f"{self.source}: {key}={value!r} is not supported (supported: {', '.join(map(repr, allowed))})"
            )
        return value


def auto_head_dim(get: Getter, key: str, n_heads: int, expand: int, hidden: int) -> int:
    """`mamba_d_head` may be "auto" (or absent): the inner width mamba_expand * hidden_size split over the heads."""
    value = get.raw.get(key, "auto")
    if value in (None, "auto"):
        if (expand * hidden) % n_heads:
            raise InvalidArgumentError(
                f"{get.source}: mamba_n_heads={n_heads} does not divide mamba_expand*hidden_size={expand * hidden}"
            )
        return expand * hidden // n_heads
    return get.integer(key)


def check_inner_width(source: str, n_heads: int, d_head: int, expand: int, hidden: int) -> None:
    """Bamba and Granite size the Mamba inner width twice; the two must agree."""
    if n_heads * d_head != expand * hidden:
        raise InvalidArgumentError(
            f"{source}: mamba_n_heads*mamba_d_head={n_heads * d_head} must equal "
            f"mamba_expand*hidden_size={expand * hidden}"
        )


def rope_fields(get: Getter, head_dim: int, partial_default: float) -> tuple[int, float]:
    """(rotary dim, theta) from `rope_parameters` (transformers 5) or the older top-level `rope_theta`."""
    rope = get.raw.get("rope_parameters") or get.raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise InvalidArgumentError(f"{get.source}: rope_parameters must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise InvalidArgumentError(f"{get.source}: rope_parameters.rope_type={rope_type!r} is not supported "
                                   f"(supported: 'default')")  # fmt: skip
    theta = float(rope.get("rope_theta", get.raw.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", get.raw.get("partial_rotary_factor", partial_default)))
    if not 0 < partial <= 1:
        raise InvalidArgumentError(f"{get.source}: partial_rotary_factor={partial} must be in (0, 1]")
    return int(head_dim * partial), theta


def split_block_name(name: str) -> tuple[int, str]:
    """'blocks.7.mixer.in_proj.weight' -> (7, 'mixer.in_proj.weight')."""
    _, index, rest = name.split(".", 2)
    return int(index), rest
