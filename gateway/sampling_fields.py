"""The OpenAI sampling controls vLLM accepts beside OpenAI's own (`presence_penalty`, `frequency_penalty`,
`repetition_penalty`, `min_p`, `logit_bias`, `min_tokens`, `stop_token_ids`), on /v1/completions and
/v1/chat/completions alike: parsed into a frozen `SamplingControls`, then copied onto the worker's
`SamplingParams` (`fill_sampling`). Pure: JSON in, dataclass out, `ApiError` (400) naming the field.

The ranges are the worker's (it checks them again, with the vocabulary, which the gateway may not know):
penalties in [-2, 2], repetition_penalty > 0, min_p in [0, 1], logit_bias values in [-100, 100] keyed by
token ids written as strings (OpenAI's JSON shape), min_tokens >= 0."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.api_errors import bad_request, number_field

if TYPE_CHECKING:  # pure at run time: the message is only written to (gateway/test_layering.py)
    from hybridserve.v1 import generation_pb2 as pb

MAX_LOGIT_BIAS = 1024  # entries (the worker's limit)
MAX_STOP_TOKEN_IDS = 64  # ids (the worker's limit)
MAX_TOKEN_ID = 2**31  # token ids travel as int32

CONTROL_FIELDS = frozenset(
    {
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "logit_bias",
        "min_tokens",
        "stop_token_ids",
    }
)


@dataclass(frozen=True, slots=True)
class SamplingControls:
    """The controls of one request; the defaults are off."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None = off (1)
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()


def _token_id(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_TOKEN_ID:
        raise bad_request(f"'{name}' must hold token ids (integers >= 0), got {value!r:.60}", name, "invalid_value")
    return value


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise bad_request("'logit_bias' must be an object of token id -> bias", "logit_bias", "invalid_type")
    if len(raw) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' holds {len(raw)} tokens; at most {MAX_LOGIT_BIAS}", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in raw.items():
        text = str(key).strip()
        if not (text.isascii() and text.isdigit()):
            raise bad_request(
                f"'logit_bias' keys must be token ids (integers as strings), got {key!r:.40}", "logit_bias",
                "invalid_value",
            )  # fmt: skip
        token = _token_id(int(text), "logit_bias")
        value = number_field({"logit_bias": bias}, "logit_bias", -100.0, 100.0)
        if value is None:
            raise bad_request(f"'logit_bias' of token {token} must be a number, got null", "logit_bias")
        out[token] = value
    return tuple(sorted(out.items()))


def _stop_token_ids(body: Mapping[str, Any]) -> tuple[int, ...]:
    raw = body.get("stop_token_ids")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad_request("'stop_token_ids' must be a list of token ids", "stop_token_ids", "invalid_type")
    if len(raw) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' holds {len(raw)} ids; at most {MAX_STOP_TOKEN_IDS}", "stop_token_ids")
    return tuple(_token_id(t, "stop_token_ids") for t in raw)


def _min_tokens(body: Mapping[str, Any]) -> int:
    value = body.get("min_tokens")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 30:
        raise bad_request(f"'min_tokens' must be an integer >= 0, got {value!r:.60}", "min_tokens", "invalid_value")
    return value


def parse_controls(body: Mapping[str, Any]) -> SamplingControls:
    """The controls of a request body (fields absent or null are off)."""
    return SamplingControls(
        presence_penalty=number_field(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=number_field(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        repetition_penalty=number_field(body, "repetition_penalty", 0.0, 1e9, low_open=True),
        min_p=number_field(body, "min_p", 0.0, 1.0) or 0.0,
        logit_bias=_logit_bias(body),
        min_tokens=_min_tokens(body),
        stop_token_ids=_stop_token_ids(body),
    )


def check_min_tokens(controls: SamplingControls, max_tokens: int) -> None:
    """min_tokens above a max_tokens the request names (0: the worker's default, checked there)."""
    if max_tokens and controls.min_tokens > max_tokens:
        raise bad_request(
            f"'min_tokens' ({controls.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens",
            "invalid_value",
        )  # fmt: skip


def fill_sampling(controls: SamplingControls, sampling: pb.SamplingParams) -> None:
    """Copies the controls onto the worker's SamplingParams (off ones stay unset)."""
    sampling.presence_penalty = controls.presence_penalty
    sampling.frequency_penalty = controls.frequency_penalty
    if controls.repetition_penalty is not None:
        sampling.repetition_penalty = controls.repetition_penalty
    sampling.min_p = controls.min_p
    for token, bias in controls.logit_bias:
        sampling.logit_bias[token] = bias
    sampling.min_tokens = controls.min_tokens
    sampling.stop_token_ids.extend(controls.stop_token_ids)
