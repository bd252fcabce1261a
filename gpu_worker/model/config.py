"""The Bamba model config, parsed once from a checkpoint's `config.json` and validated.

Only the fields the forward pass reads are kept; anything the runner cannot honour (another activation,
another RoPE type, dimensions that do not divide) is rejected here with a message naming the field, so a
bad checkpoint fails at load time instead of producing silent garbage."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridserve.errors import InvalidArgumentError

SUPPORTED_ARCHITECTURES = ("BambaForCausalLM",)


@dataclass(frozen=True, slots=True)
class BambaConfig:
    """Architecture of a Bamba checkpoint (see DESIGN §4). Derived sizes are properties."""

    vocab_size: int  # number of token ids
    hidden_size: int  # model width (channels)
    intermediate_size: int  # SwiGLU MLP width (channels)
    num_hidden_layers: int
    attn_layer_indices: tuple[int, ...]  # layers that are attention; all others are Mamba2
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float
    partial_rotary_factor: float  # fraction of each head's dims that RoPE rotates (Bamba: 0.5)
    mamba_n_heads: int
    mamba_d_head: int  # channels per SSM head
    mamba_n_groups: int  # B/C groups (heads share B and C within a group)
    mamba_d_state: int  # SSM state size N
    mamba_d_conv: int  # causal conv kernel width (tokens)
    mamba_expand: int
    mamba_chunk_size: int  # SSD scan chunk length (tokens)
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    time_step_min: float  # dt clamp, lower bound
    time_step_max: float  # dt clamp, upper bound (may be inf)
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each attention head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def d_inner(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def conv_dim(self) -> int:
        """Channels through the causal conv: x, B and C."""
        return self.d_inner + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def is_attention_layer(self) -> tuple[bool, ...]:
        attn = set(self.attn_layer_indices)
        return tuple(i in attn for i in range(self.num_hidden_layers))

    @property
    def num_attention_layers(self) -> int:
        return len(self.attn_layer_indices)

    @property
    def num_mamba_layers(self) -> int:
        return self.num_hidden_layers - self.num_attention_layers

    def to_canonical_json(self) -> str:
        """A stable serialisation (sorted keys, inf spelled out) for fingerprints."""
        return json.dumps(asdict(self), sort_keys=True, default=str, allow_nan=True)

    # ---- parsing -------------------------------------------------------------------------------------
    @classmethod
    def from_json_file(cls, path: Path) -> BambaConfig:
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise InvalidArgumentError(f"{path}: expected a JSON object at the top level")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> BambaConfig:
        """Parse a Hugging Face `config.json` dict. Raises InvalidArgumentError naming the bad field."""
        _check_architecture(raw, source)
        get = _Getter(raw, source)
        hidden = get.int("hidden_size")
        n_heads = get.int("num_attention_heads")
        n_kv = raw.get("num_key_value_heads") or n_heads
        mamba_expand = get.int("mamba_expand", 2)
        mamba_n_heads = get.int("mamba_n_heads", 128)
        d_head_raw = raw.get("mamba_d_head", "auto")
        d_head = mamba_expand * hidden // mamba_n_heads if d_head_raw in (None, "auto") else int(d_head_raw)
        if raw.get("hidden_act", "silu") != "silu":
            raise InvalidArgumentError(f"{source}: hidden_act={raw['hidden_act']!r} is unsupported (only 'silu')")
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise InvalidArgumentError(
                f"{source}: rope_parameters.rope_type={rope['rope_type']!r} is unsupported (only 'default')"
            )
        t_min, t_max = _parse_time_step_limit(raw.get("time_step_limit", [0.0, math.inf]), source)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=get.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get.int("intermediate_size"),
            num_hidden_layers=get.int("num_hidden_layers"),
            attn_layer_indices=tuple(int(i) for i in (raw.get("attn_layer_indices") or ())),
            num_attention_heads=n_heads,
            num_key_value_heads=int(n_kv),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.5)),
            mamba_n_heads=mamba_n_heads,
            mamba_d_head=d_head,
            mamba_n_groups=get.int("mamba_n_groups", 1),
            mamba_d_state=get.int("mamba_d_state", 256),
            mamba_d_conv=get.int("mamba_d_conv", 4),
            mamba_expand=mamba_expand,
            mamba_chunk_size=get.int("mamba_chunk_size", 256),
            mamba_conv_bias=bool(raw.get("mamba_conv_bias", True)),
            mamba_proj_bias=bool(raw.get("mamba_proj_bias", False)),
            time_step_min=t_min,
            time_step_max=t_max,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=raw.get("pad_token_id"),
        )


class _Getter:
    """Reads required/optional integer fields with a message that names the field and the file."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self._raw, self._source = raw, source

    def int(self, key: str, default: int | None = None) -> int:
        value = self._raw.get(key, default)
        if value is None:
            raise InvalidArgumentError(f"{self._source}: required field {key!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{self._source}: {key} must be an integer, got {value!r}")
        return value


def _check_architecture(raw: dict[str, Any], source: str) -> None:
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if model_type != "bamba" or (archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs)):
        raise InvalidArgumentError(
            f"{source}: unsupported architecture (model_type={model_type!r}, architectures={archs}); "
            f"this runner serves Bamba checkpoints ({', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def _parse_float(value: Any, source: str) -> float:
    """JSON cannot spell infinity; transformers writes it as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{source}: time_step_limit entry {value!r} is not a number") from exc


def _parse_time_step_limit(value: Any, source: str) -> tuple[float, float]:
    if value is None:
        return 0.0, math.inf
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise InvalidArgumentError(f"{source}: time_step_limit must be a pair [min, max], got {value!r}")
    return _parse_float(value[0], source), _parse_float(value[1], source)


def _validate(c: BambaConfig) -> None:
    """Shape rules the forward pass relies on; each message names the field and the fix."""

    def bad(msg: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"config.json: {msg}")

    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
                 "mamba_d_conv", "mamba_expand", "mamba_chunk_size"):  # fmt: skip
        if getattr(c, name) <= 0:
            raise bad(f"{name} must be positive, got {getattr(c, name)}")
    if c.hidden_size % c.num_attention_heads:
        raise bad(f"hidden_size={c.hidden_size} is not divisible by num_attention_heads={c.num_attention_heads}")
    if c.num_attention_heads % c.num_key_value_heads:
        raise bad(
            f"num_attention_heads={c.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={c.num_key_value_heads}"
        )
    if c.rotary_dim % 2 or not 0 < c.partial_rotary_factor <= 1:
        raise bad(f"partial_rotary_factor={c.partial_rotary_factor} must give an even rotary dim in (0, head_dim]")
    if c.mamba_n_heads * c.mamba_d_head != c.d_inner:
        raise bad(
            f"mamba_n_heads*mamba_d_head={c.mamba_n_heads * c.mamba_d_head} must equal "
            f"mamba_expand*hidden_size={c.d_inner}"
        )
    if c.mamba_n_heads % c.mamba_n_groups:
        raise bad(f"mamba_n_heads={c.mamba_n_heads} is not divisible by mamba_n_groups={c.mamba_n_groups}")
    if c.d_inner % c.mamba_n_groups:
        raise bad(f"mamba d_inner={c.d_inner} is not divisible by mamba_n_groups={c.mamba_n_groups}")
    bad_layers = [i for i in c.attn_layer_indices if not 0 <= i < c.num_hidden_layers]
    if bad_layers:
        raise bad(f"attn_layer_indices {bad_layers} are outside [0, num_hidden_layers={c.num_hidden_layers})")
    if not c.time_step_min <= c.time_step_max:
        raise bad(f"time_step_limit min {c.time_step_min} exceeds max {c.time_step_max}")
